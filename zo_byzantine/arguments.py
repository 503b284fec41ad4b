"""``ZOByzantineArguments``: ``TrainingArguments`` plus the federated zeroth-order protocol."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import MISSING, dataclass, field
from typing import Literal, get_args

from transformers import TrainingArguments

from .aggregators import AGGREGATORS, PRE_AGGREGATORS, build_aggregator, parse_step
from .attacks import ATTACKS, build_attack
from .bounds import check_bounds
from .context import SizingError
from .directions import DISTRIBUTIONS, GENERATORS, build_directions
from .estimators import ESTIMATORS
from .federation import PARTITIONS, byzantine_mask
from .messages import LOCAL_UPDATES
from .optim import SERVER_OPTIMIZERS
from .server import Settings
from .trusted import trusted_clients
from .validation import check_choice, check_integer, check_real

logger = logging.getLogger(__name__)

Estimator = Literal["two_point", "one_point", "gradient_projection", "first_order"]
Partition = Literal["iid", "dirichlet", "shards"]
LocalUpdate = Literal["unbiased", "biased", "compressed"]
Directions = Literal["shared", "per_client"]
AggregationSpace = Literal["projection", "parameter"]
ScheduleName = Literal["auto", "two_forwards", "cached", "antithetic"]
GeneratorName = Literal["counter", "torch"]
Distribution = Literal["gaussian", "rademacher"]
ByzantineSelection = Literal["first", "random"]
ServerOptimizer = Literal["sgd", "amsgrad"]
UpdateRounding = Literal["stochastic", "nearest"]

DIRECTIONS = get_args(Directions)
AGGREGATION_SPACES = get_args(AggregationSpace)
SCHEDULES = get_args(ScheduleName)
assert set(get_args(GeneratorName)) == set(GENERATORS) and set(get_args(Distribution)) == set(DISTRIBUTIONS)
BYZANTINE_SELECTIONS = get_args(ByzantineSelection)
assert set(get_args(Partition)) == set(PARTITIONS) and set(get_args(LocalUpdate)) == set(LOCAL_UPDATES)
assert set(get_args(ServerOptimizer)) == set(SERVER_OPTIMIZERS) and set(get_args(Estimator)) <= set(ESTIMATORS.names())


def _names(registry) -> str:
    return ", ".join(registry.names())


MAX_LEARNING_RATE = 100.0  # larger steps are refused as mistakes (ZO steps multiply Gaussian directions)
MAX_ZO_EPS = 1.0  # a perturbation larger than 1 in parameter units measures no derivative


# TrainingArguments fields the protocol replaces: refused (by name, with what to use) when set away from the default
REPLACED = {
    "optim": "the update is the protocol's ZOOptimizer; choose server_optimizer (sgd or amsgrad)",
    "optim_args": "the update is the protocol's ZOOptimizer; see server_betas, server_eps, server_v0",
    "adam_beta1": "no Adam: set server_betas for server_optimizer='amsgrad'",
    "adam_beta2": "no Adam: set server_betas for server_optimizer='amsgrad'",
    "adam_epsilon": "no Adam: set server_eps for server_optimizer='amsgrad'",
    "max_grad_norm": "zeroth-order rounds have no gradient to clip; clip the clients' vectors with "
                     "pre_aggregators=['clip:c=...'] (the default 1.0 is accepted and unused)",
    "label_smoothing_factor": "the clients' losses are the model's per-example losses; smooth inside the model",
    "torch_compile": "the perturbation swaps parameters per module call, which makes dynamo recompile every call "
                     "(measured: 45 s instead of 0.9 s for 20 rounds); compile is not supported",
    "group_by_length": "the federated sampler fixes each round's batch (B examples of every participant); "
                       "zo_group_by_length=True groups a round's forwards by length",
    "train_sampling_strategy": "the federated sampler fixes each round's batch (B examples of every participant); "
                               "to cut a round's padding, zo_group_by_length=True groups its forwards by length",
    "auto_find_batch_size": "per_device_train_batch_size is each client's batch B, part of the protocol",
    "neftune_noise_alpha": "noise in the embeddings would differ between the +mu and -mu forwards",
    "past_index": "rounds evaluate per-example losses only",
    "deepspeed": "one device per process holds the whole model; sharded perturbation is not implemented",
    "fsdp": "one device per process holds the whole model; sharded perturbation is not implemented",
    "activation_checkpointing": "zeroth-order forwards keep no activations (no backward: memory is inference's), "
                                "and the clients' forwards run in eval mode, where transformers skips checkpointing",
    "gradient_checkpointing": "zeroth-order forwards keep no activations (no backward: memory is inference's), "
                              "and the clients' forwards run in eval mode, where transformers skips checkpointing",
}


def _refuse_replaced(args) -> None:
    defaults = TrainingArguments.__dataclass_fields__
    for name, reason in REPLACED.items():
        field_ = defaults.get(name)
        if field_ is None:
            continue
        default = field_.default if field_.default is not MISSING else field_.default_factory()
        value = getattr(args, name)
        unset = value in (None, "", [], False) and default in (None, "", [], False)
        if value != default and not unset and not (name == "max_grad_norm" and value in (0, 0.0, None)):
            raise ValueError(f"{name}={value!r} is not used by ZOByzantineTrainer: {reason}.")


@dataclass
class ZOByzantineArguments(TrainingArguments):
    r"""
    Arguments of [`ZOByzantineTrainer`]: all of `TrainingArguments`, plus the protocol's.
    One optimisation step is one federated round; `per_device_train_batch_size` is the mini-batch
    size `B` of each client; `learning_rate` is the server step `eta`.

    Parameters that control the federation:
        num_clients (`int`, defaults to 12): `n`, the number of clients.
        num_byzantine (`int`, defaults to 0): `b < n/2`, the number of Byzantine clients.
        max_byzantine_per_round (`int`, *optional*): `f`, the Byzantine vectors each round's rule must tolerate;
            defaults to `b` (at most the `m` vectors received). With `clients_per_round = m < n` a round holds
            up to `min(b, m)` Byzantine clients; a smaller `f` lets a rule run on fewer vectors, and rounds that
            sample more than `f` Byzantine clients are counted in the logs (`byzantine_over_bound`).
        byzantine_selection (`str`, defaults to `"first"`): `"first"` (clients 0..b-1) or `"random"` (seeded).
        clients_per_round (`int`, *optional*): clients drawn each round (seeded); all by default.
        partition (`str`, defaults to `"iid"`): `"iid"`, `"dirichlet"` or `"shards"`.
        dirichlet_alpha (`float`, defaults to 1.0): concentration of the Dirichlet partition.
        min_client_examples (`int`, defaults to 1): fewest examples a client may hold.
        root_examples (`int`, defaults to 0): with `aggregator="fltrust"`, the data of its trusted clients
            (`aggregator_kwargs["trusted"]`): this many training examples drawn uniformly (seeded) from the whole
            training set in place of their partition share (FLTrust's root data set, drawn from the task's
            distribution); 0 keeps their share.

    Parameters that control the zeroth-order estimate:
        estimator (`str`, defaults to `"two_point"`): `"two_point"`, `"one_point"`, `"gradient_projection"` or
            `"first_order"` (FedAvg baseline: backprop gradients in R^d).
        zo_eps (`float`, defaults to 1e-3): perturbation scale `mu`.
        num_perturbations (`int`, defaults to 1): shared directions per local step, `nu`.
        local_steps (`int`, defaults to 1): local steps per round, `K`.
        local_update (`str`, defaults to `"unbiased"`): `"unbiased"`, `"biased"` or `"compressed"` (for `K > 1`).
        zo_seed (`int`, *optional*): the shared seed `s`; defaults to `seed`.
        zo_forward_batch_size (`int`, defaults to 0): examples per forward chunk; 0 evaluates all clients at once
            (with `zo_group_by_length`, in chunks of `per_device_train_batch_size`).
        zo_group_by_length (`bool`, defaults to `False`): each forward's chunks hold examples of similar length
            (`zo_forward_batch_size` each, else `per_device_train_batch_size`), each chunk cut to its own longest
            example (the last attended or target token): the same losses up to rounding, without the forwards
            over padding to the round's longest example (`benchmarks/padding.py`: MiniLM, 12 clients x 16 SST-2
            sentences, one CPU thread: 3.1x fewer seconds per round). Needs an `attention_mask`; right padding is
            cut, left padding kept. Split forwards make `"auto"` keep the round's directions (`"cached"`) when they
            fit `zo_cache_budget_gb`, so that z is drawn once, not once per chunk.
        zo_direction_batch_size (`int`, defaults to 0): `n_B`: direction `r` of a client is evaluated on examples
            `[r n_B, (r+1) n_B)` of its batch (FedES, paper 001: one loss difference per batch of `n_B`), so
            `per_device_train_batch_size = num_perturbations * n_B`; two-point estimator, one local step. 0: every
            direction on the client's whole batch.
        zo_schedule (`str`, defaults to `"auto"`): how a two-point estimate is evaluated; every schedule gives the
            losses of two forwards. `"two_forwards"`: two forwards, z drawn (fused into p + c z) for each and for the
            update (3 generator passes per direction; inference-level memory). `"cached"`: the round's directions
            are kept after the first draw for the second forward and the update (1 pass; nu*d extra float32).
            `"antithetic"`: one forward of the doubled batch, each module drawing z once for +mu and -mu (2 passes;
            doubled activations; checked against two forwards at its first round). `"auto"`: two_forwards when the
            generator draws and adds in one fused pass (the counter generator's CPU kernel: regenerating z costs
            less than reading it back) and each forward is one chunk, else cached when the round's directions fit
            `zo_cache_budget_gb`, else two_forwards. `"auto"` also stacks the 2 nu models of a step into one
            forward (one matrix product of a shared input with every direction's weights: logistic regression,
            MLPs; per-client directions: each client's 2 nu models on its own examples) when 2 nu copies of the
            trainable weights fit the budget and the stacked losses equal the one-at-a-time ones at the first
            round (equal up to rounding, not bitwise). When the clients hold different models (local steps
            after the first; per-client directions), `"auto"` evaluates all of them in one forward (a batched
            matrix product per `nn.Linear`, the rows each client reads of each `nn.Embedding`, other modules once
            per client) when it fits the budget and gives the client-by-client losses at its first use.
        zo_cache_budget_gb (`float`, defaults to 1.0): memory `"auto"` may spend on keeping a round's directions
            (nu * K * d values) when they are not drawn by a fused kernel and on stacked models (2 nu * d); with
            local steps (K > 1), any schedule keeps each client's local model ((n + 1) * d float32/64 values)
            within it instead of regenerating its earlier steps at every forward, and `"auto"` stacks the clients
            when (n + 3) * d plus (n + 1) times the linear layers' weights fit. 0 keeps memory at inference
            level.
        zo_generator (`str`, defaults to `"counter"`): the direction generator. `"counter"`: a counter-based
            stream, the same bits on every device (CPU or GPU), drawn and added in one fused pass. `"torch"`:
            `torch.randn` per tensor (the stream of runs made before 0.2), drawn on the CPU and copied to the device.
        zo_distribution (`str`, defaults to `"gaussian"`): `"gaussian"` (the papers') or `"rademacher"` (+-1;
            `zo_generator="counter"` only).
        local_learning_rate (`float`, *optional*): step of the clients' local ZO-SGD steps; defaults to `learning_rate`.
        directions (`str`, defaults to `"shared"`): `"shared"` (FedByZO) or `"per_client"` (FedES, paper 001).
        aggregation_space (`str`, defaults to `"projection"`): rules on R^nu vectors, or `"parameter"` on the
            reconstructed R^d estimates (FedZO baseline; memory n*d).
        dense_memory_limit_gb (`float`, *optional*): largest n*d*8 bytes accepted for R^d aggregation; 1/4 of RAM.
        server_optimizer (`str`, defaults to `"sgd"`): `"sgd"` or `"amsgrad"` (ZO-AdaFL; dense state 3d floats).
        server_betas, server_eps, server_v0: AMSGrad's (0.9, 0.99), 1e-8 (inside the square root), 1e-5.
        update_rounding (`str`, defaults to `"stochastic"`): how the update is written into weights held in bfloat16
            or float16: `"stochastic"` computes it in float32 and rounds stochastically (unbiased, seeded by the
            round's seeds: every party and a ledger replay round alike), so that steps below the dtype's resolution
            (a MeZO-sized lr) still train; `"nearest"` rounds to nearest (such steps are lost; warned once).
            float32 and float64 weights are written the same way under both.

    Parameters that control aggregation and attacks:
        aggregator (`str`, defaults to `"mean"`): robust rule, by registered name.
        aggregator_kwargs (`dict` or `str`, *optional*): its parameters (a JSON string on the command line).
        pre_aggregators (`list[str]`, *optional*): steps applied before the rule, in order: `nnm`, `clip:c=1.0`,
            `bucketing:s=2`.
        attack (`str`, defaults to `"none"`): what the Byzantine clients send, by registered name.
        attack_kwargs (`dict` or `str`, *optional*): its parameters.
    """

    aggregator: str = field(
        default="mean", metadata={"help": f"Aggregation rule, by registered name: {_names(AGGREGATORS)}."}
    )
    aggregator_kwargs: dict | str | None = field(default=None, metadata={"help": "Rule parameters (JSON object)."})
    pre_aggregators: list[str] = field(
        default_factory=list,
        metadata={"help": f"Pre-aggregation steps, in order ({_names(PRE_AGGREGATORS)}; e.g. bucketing:s=2)."},
    )
    attack: str = field(default="none", metadata={"help": f"Byzantine attack, by registered name: {_names(ATTACKS)}."})
    attack_kwargs: dict | str | None = field(default=None, metadata={"help": "Attack parameters (JSON object)."})
    num_clients: int = field(default=12, metadata={"help": "Number of clients n."})
    num_byzantine: int = field(default=0, metadata={"help": "Number of Byzantine clients b (< n/2)."})
    max_byzantine_per_round: int | None = field(
        default=None, metadata={"help": "Byzantine vectors f each round's rule tolerates (0 <= f <= b); b if unset."}
    )
    byzantine_selection: ByzantineSelection = field(default="first", metadata={"help": "first or random (seeded)."})
    clients_per_round: int | None = field(default=None, metadata={"help": "Clients drawn per round; all if unset."})
    partition: Partition = field(default="iid", metadata={"help": "Training set over clients: iid, dirichlet, shards."})
    dirichlet_alpha: float = field(default=1.0, metadata={"help": "Dirichlet concentration (> 0)."})
    min_client_examples: int = field(default=1, metadata={"help": "Minimum examples per client."})
    root_examples: int = field(default=0, metadata={"help": "fltrust: examples drawn uniformly for the trusted clients "
                                                            "(the root data set); 0 keeps their share."})
    estimator: Estimator = field(
        default="two_point", metadata={"help": "two_point, one_point, gradient_projection or first_order."}
    )
    zo_eps: float = field(default=1e-3, metadata={"help": "Perturbation scale mu."})
    num_perturbations: int = field(default=1, metadata={"help": "Directions per local step nu."})
    local_steps: int = field(default=1, metadata={"help": "Local steps per round K."})
    local_update: LocalUpdate = field(default="unbiased", metadata={"help": "unbiased, biased or compressed (K > 1)."})
    zo_seed: int | None = field(default=None, metadata={"help": "Shared seed s of the directions; defaults to seed."})
    zo_forward_batch_size: int = field(default=0, metadata={"help": "Examples per forward chunk; 0 = all at once."})
    zo_group_by_length: bool = field(
        default=False, metadata={"help": "Forward chunks of examples of similar length, each cut to its longest."})
    zo_direction_batch_size: int = field(
        default=0, metadata={"help": "n_B: each direction on its own n_B examples of the client's batch (FedES); "
                                     "0 = every direction on the whole batch."}
    )
    zo_schedule: ScheduleName = field(
        default="auto", metadata={"help": "auto (two_forwards with fused draws and unsplit forwards, else cached, "
                                          "within zo_cache_budget_gb; stacked models where they apply), two_forwards, "
                                          "cached or antithetic."}
    )
    zo_cache_budget_gb: float = field(
        default=1.0, metadata={"help": "Memory zo_schedule='auto' may spend on keeping a round's directions."}
    )
    zo_generator: GeneratorName = field(
        default="counter", metadata={"help": "counter (same bits on every device) or torch (runs before 0.2)."}
    )
    zo_distribution: Distribution = field(
        default="gaussian", metadata={"help": "gaussian or rademacher (counter generator only)."}
    )
    local_learning_rate: float | None = field(default=None, metadata={"help": "Local ZO-SGD step; lr if unset."})
    directions: Directions = field(default="shared", metadata={"help": "shared (FedByZO) or per_client (FedES)."})
    aggregation_space: AggregationSpace = field(
        default="projection", metadata={"help": "projection (R^nu) or parameter (R^d)."}
    )
    dense_memory_limit_gb: float | None = field(default=None, metadata={"help": "Cap for R^d aggregation memory."})
    server_optimizer: ServerOptimizer = field(default="sgd", metadata={"help": "sgd or amsgrad (ZO-AdaFL)."})
    server_betas: list[float] = field(
        default_factory=lambda: [0.9, 0.99], metadata={"help": "AMSGrad betas, two numbers (e.g. 0.9 0.99)."}
    )
    server_eps: float = field(default=1e-8, metadata={"help": "AMSGrad eps (inside the square root)."})
    server_v0: float = field(default=1e-5, metadata={"help": "AMSGrad initial second moment."})
    update_rounding: UpdateRounding = field(
        default="stochastic", metadata={"help": "stochastic (bf16/fp16 weights: unbiased seeded rounding of the "
                                                "float32 update) or nearest."}
    )

    def __post_init__(self):
        self.validate_numbers()  # before TrainingArguments' own checks, whose messages would mislead
        _refuse_replaced(self)
        super().__post_init__()
        for name in ("aggregator_kwargs", "attack_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{name} must be a JSON object, got {value!r}: {err}") from err
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{name} must be a dict (or a JSON object string), got {value!r}.")
            setattr(self, name, value or {})
        if self.zo_seed is None:
            self.zo_seed = self.seed
        self.validate_protocol()

    def protocol_settings(self) -> Settings:
        """The settings the server role runs with."""
        return Settings(self.zo_seed, self.estimator, self.zo_eps, self.num_perturbations, self.local_steps,
                        self.local_update, self.directions, self.aggregation_space, self.byzantine_bound())

    def check_trusted(self) -> None:
        """The trusted clients exist, are never Byzantine, take part in every round; ``root_examples`` only for them."""
        trusted = trusted_clients(self.aggregator, self.aggregator_kwargs)
        if self.root_examples and not trusted:
            raise ValueError(f"root_examples={self.root_examples} is the data of the clients the server trusts; "
                             f"aggregator={self.aggregator!r} with aggregator_kwargs={self.aggregator_kwargs} names "
                             "none. Accepted: root_examples=0, or aggregator='fltrust' with "
                             "aggregator_kwargs={'trusted': [ids]}.")
        if not trusted:
            return
        if max(trusted) >= self.num_clients:
            raise ValueError(f"aggregator_kwargs trusted={list(trusted)}: client ids must be < num_clients="
                             f"{self.num_clients}.")
        byzantine = byzantine_mask(self.num_clients, self.num_byzantine, self.zo_seed, self.byzantine_selection)
        drawn = [c for c in trusted if byzantine[c]]
        if drawn:
            how = (f"clients 0..{self.num_byzantine - 1} are Byzantine" if self.byzantine_selection == "first" else
                   f"clients {drawn} are drawn Byzantine for zo_seed={self.zo_seed}")
            raise ValueError(f"aggregator_kwargs trusted={list(trusted)} names Byzantine clients: with "
                             f"byzantine_selection={self.byzantine_selection!r} {how}; trust other ids.")
        steps = [*self.pre_aggregators, *(self.aggregator_kwargs.get("base_pre_aggregators") or ())]
        if steps:
            raise ValueError(f"pre-aggregation {steps} before fltrust: a step that mixes rows would mix Byzantine rows "
                             "into the trusted reference; accepted: pre_aggregators=[] (and base_pre_aggregators=[] in "
                             "history around it).")
        if self.clients_per_round not in (None, self.num_clients):
            raise ValueError(f"clients_per_round={self.clients_per_round} with trusted clients ({self.aggregator!r}): "
                             "a round drawn without one has no reference; accepted: clients_per_round=None (all).")
        if self.scalar_reports():
            logger.warning(
                "aggregator=%r trusts clients %s with num_perturbations=1: every report is one scalar, so FLTrust's "
                "output is the trusted clients' sign (at the median size where scale='median'): the other clients "
                "vote on nothing else. On SmolLM2 (SST-2, 2 examples a client and round) that fell below zero-shot "
                "without attack (experiments/smollm2/README.md). Use num_perturbations > 1, or a rule that averages "
                "the clients (e.g. cwtm).", self.aggregator, list(trusted))

    def scalar_reports(self) -> bool:
        """Every rule call gets one scalar a client: one direction a round, aggregated in projection space."""
        one = self.num_perturbations == 1 and self.aggregation_space == "projection"
        return one and self.estimator != "first_order"

    def check_history(self) -> None:
        """Warn where issue 46's history rule cannot tell attackers from honest clients: one scalar a report."""
        if self.aggregator == "history" and self.scalar_reports():
            logger.warning(
                "aggregator='history' with num_perturbations=1: every report is one scalar, so the rule's sign "
                "balance is +1 or -1 for every client and its other statistics reward a value near the round's "
                "consensus. On SmolLM2 (SST-2) it scored ALIE's, SF's and FOE's clients above every honest client "
                "and left none of them out (experiments/smollm2/README.md, reports.py). Use num_perturbations > 1.")

    def byzantine_bound(self) -> int:
        """``f``: the Byzantine vectors each round's rule tolerates (``max_byzantine_per_round`` or ``b``)."""
        return self.num_byzantine if self.max_byzantine_per_round is None else self.max_byzantine_per_round

    def check_sizing(self, rule) -> None:
        """Refuse a pipeline that cannot hold for the vectors of a round: ``m = clients_per_round`` (or ``n``)
        vectors, ``f = min(max_byzantine_per_round or b, m)`` of them Byzantine."""
        m = self.clients_per_round or self.num_clients
        f = min(self.byzantine_bound(), m)
        try:
            rule.check(m, f)
        except SizingError as err:
            bound = f"max_byzantine_per_round={self.max_byzantine_per_round}" \
                if self.max_byzantine_per_round is not None else f"num_byzantine={self.num_byzantine}"
            raise ValueError(
                f"aggregator={rule.name!r} cannot hold for the vectors of a round: clients_per_round="
                f"{self.clients_per_round} (m={m} vectors), num_byzantine={self.num_byzantine}, bound f={f} "
                f"({bound}): {err} Sample more clients, lower num_byzantine, or set max_byzantine_per_round "
                "(0 <= f <= b)."
            ) from err

    def validate_numbers(self) -> None:
        """Every numeric field: its type and range, naming the field and what is accepted."""
        check_real("learning_rate", self.learning_rate, 0.0, MAX_LEARNING_RATE)
        check_real("weight_decay", self.weight_decay, 0.0, 1.0)
        check_integer("per_device_train_batch_size", self.per_device_train_batch_size, 1)
        check_integer("per_device_eval_batch_size", self.per_device_eval_batch_size, 1)
        check_integer("seed", self.seed, 0, 2**32 - 1)
        for name in ("num_clients", "num_perturbations", "local_steps", "min_client_examples"):
            check_integer(name, getattr(self, name), 1)
        check_integer("num_byzantine", self.num_byzantine, 0)
        check_integer("root_examples", self.root_examples, 0)
        check_integer("zo_forward_batch_size", self.zo_forward_batch_size, 0)
        check_integer("zo_direction_batch_size", self.zo_direction_batch_size, 0)
        if not isinstance(self.zo_group_by_length, bool):
            raise ValueError(f"zo_group_by_length={self.zo_group_by_length!r} must be True or False.")
        check_real("zo_cache_budget_gb", self.zo_cache_budget_gb, 0.0)
        for name in ("clients_per_round", "max_byzantine_per_round"):
            if getattr(self, name) is not None:
                check_integer(name, getattr(self, name), 1 if name == "clients_per_round" else 0)
        if self.zo_seed is not None:  # an entry of every seed tuple: 64 bits (the ledger's and SeedSequence's range)
            check_integer("zo_seed", self.zo_seed, 0, 2**64 - 1)
        check_real("zo_eps", self.zo_eps, 0.0, MAX_ZO_EPS, low_open=ESTIMATORS.get(self.estimator).uses_mu
              if self.estimator in ESTIMATORS else True)
        if self.local_learning_rate is not None:
            check_real("local_learning_rate", self.local_learning_rate, 0.0, MAX_LEARNING_RATE)
        if isinstance(self.dirichlet_alpha, int | float) and self.dirichlet_alpha == math.inf:
            raise ValueError("dirichlet_alpha=inf: for identically distributed clients use partition='iid'.")
        check_real("dirichlet_alpha", self.dirichlet_alpha, 0.0, low_open=True)
        if self.dense_memory_limit_gb is not None:
            check_real("dense_memory_limit_gb", self.dense_memory_limit_gb, 0.0, low_open=True)
        check_real("server_eps", self.server_eps, 0.0, low_open=True)
        check_real("server_v0", self.server_v0, 0.0)
        betas = self.server_betas
        if isinstance(betas, str) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ValueError(f"server_betas={betas!r}: two numbers (beta1, beta2) in [0, 1), e.g. 0.9 0.99.")
        for i, beta in enumerate(betas):
            check_real(f"server_betas[{i}]", beta, 0.0, 1.0)
            if beta == 1.0:
                raise ValueError(f"server_betas[{i}]=1.0 must be < 1 (the moment would never move).")
        self.server_betas = tuple(float(x) for x in betas)
        check_bounds(self)  # sizes against memory and the ledger's limit, step intervals, the checkpoint to resume

    def validate_protocol(self) -> None:
        """Raise ``ValueError`` naming the field and the accepted values for any invalid setting."""
        n, b = self.num_clients, self.num_byzantine
        if not 0 <= b or 2 * b >= n:
            raise ValueError(f"num_byzantine={b} must satisfy 0 <= b < num_clients/2 = {n / 2}.")
        if self.max_byzantine_per_round is not None and not 0 <= self.max_byzantine_per_round <= b:
            raise ValueError(
                f"max_byzantine_per_round={self.max_byzantine_per_round} must be in [0, num_byzantine={b}]."
            )
        check_choice("byzantine_selection", self.byzantine_selection, BYZANTINE_SELECTIONS)
        if self.clients_per_round is not None and not 1 <= self.clients_per_round <= n:
            raise ValueError(f"clients_per_round={self.clients_per_round} must be in [1, num_clients={n}].")
        check_choice("partition", self.partition, PARTITIONS)
        check_choice("estimator", self.estimator, ESTIMATORS.names())
        check_choice("local_update", self.local_update, LOCAL_UPDATES)
        check_choice("directions", self.directions, DIRECTIONS)
        check_choice("zo_schedule", self.zo_schedule, SCHEDULES)
        build_directions(self.zo_generator, self.zo_distribution)  # names both settings when they do not fit
        check_choice("aggregation_space", self.aggregation_space, AGGREGATION_SPACES)
        check_choice("server_optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        check_choice("update_rounding", self.update_rounding, get_args(UpdateRounding))
        if self.estimator == "first_order" and (self.local_steps != 1 or self.aggregation_space != "projection"):
            raise ValueError(
                "estimator='first_order' (FedAvg) runs with local_steps=1 and aggregates in R^d already; "
                f"got local_steps={self.local_steps}, aggregation_space={self.aggregation_space!r}."
            )
        if self.directions == "per_client" and (
            self.aggregator != "mean" or self.pre_aggregators or self.aggregation_space != "projection"
            or self.local_update == "compressed"
        ):
            raise ValueError(
                "directions='per_client' (FedES) needs aggregator='mean', no pre_aggregators, aggregation_space="
                "'projection' and local_update != 'compressed': each client's scalars live in its own basis."
            )
        n_b = self.zo_direction_batch_size
        if n_b and (self.estimator != "two_point" or self.local_steps != 1
                    or self.per_device_train_batch_size != self.num_perturbations * n_b):
            raise ValueError(
                f"zo_direction_batch_size={n_b} (each direction on its own {n_b} examples) needs "
                f"estimator='two_point', local_steps=1 and per_device_train_batch_size = num_perturbations x "
                f"zo_direction_batch_size = {self.num_perturbations * n_b}; got estimator={self.estimator!r}, "
                f"local_steps={self.local_steps}, per_device_train_batch_size={self.per_device_train_batch_size}."
            )
        if self.aggregation_space == "parameter" and self.local_update == "compressed":
            raise ValueError("aggregation_space='parameter' does not combine with local_update='compressed'.")
        if self.server_optimizer == "amsgrad" and self.aggregation_space == "parameter":
            raise ValueError("server_optimizer='amsgrad' works on seeded updates (aggregation_space='projection').")
        check_choice("aggregator", self.aggregator, AGGREGATORS.names())
        for step in self.pre_aggregators:
            check_choice("pre_aggregators entry", parse_step(step)[0], PRE_AGGREGATORS.names())
        check_choice("attack", self.attack, ATTACKS.names())
        if self.attack != "none" and b == 0:
            raise ValueError(f"attack={self.attack!r} needs Byzantine clients: set num_byzantine >= 1.")
        # build once so that parameters and sizing are checked now, not at the first round
        self.check_sizing(build_aggregator(self.aggregator, self.pre_aggregators, **self.aggregator_kwargs))
        build_attack(self.attack, **self.attack_kwargs)
        self.check_trusted()
        self.check_history()
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: one optimisation step is one "
                "federated round; accepted: 1 (set the clients' batch with per_device_train_batch_size)."
            )

"""``ZOByzantineTrainer``: a drop-in ``Trainer`` whose optimisation step is one federated round.

Hugging Face glue only: it drives the protocol's two roles in one process (SPEC 8). One round:

    plan = server.plan(t, participants, local lr)
    reports = client_reports(plan, the participants' examples in one batch)   # client role, batched
    downlink = server.aggregate(plan, reports, lr, byzantine mask)             # attack (simulation), rule
    optimizer.step(): w <- w - lr * sum_k c_k z_k                              # from the downlink
"""

from __future__ import annotations

import json
import logging
import math
import os

import safetensors.torch
import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, Trainer
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import SAFE_WEIGHTS_NAME

from .aggregators import build_aggregator
from .arguments import ZOByzantineArguments
from .attacks import build_attack
from .card import rewrite_card
from .checks import build_federation, check_dense_memory, check_label_flipping, check_sizing
from .client import client_reports
from .directions import COUNTER, build_directions
from .federation import FederatedBatchSampler, Federation
from .ledger import LEDGER_NAME, Ledger, LedgerError
from .losses import PerExampleForward
from .messages import Downlink, Plan, Report
from .optim import ZOOptimizer
from .perturbation import ParameterTable
from .server import Server
from .simulation import BatchedClients, Schedule, flip_labels, forward_chunks, model_num_labels

logger = logging.getLogger(__name__)

WINDOW_KEYS = ("rounds", "skipped_rounds", "nonfinite_values", "rejected_reports", "loss_sum", "loss_count")
PER_APPLIED_ROUND = ("aggregate_shift", "honest_mean_norm")  # logged as means over applied rounds
# averaged over the uplinks that reported them; other diagnostics summed
LOG_NAMES = {"omega": "attack_omega", "lambda": "attack_lambda"}


class ZOByzantineTrainer(Trainer):
    """``Trainer`` running FedByZO rounds. Same constructor, plus optional rule/attack objects.

    Args:
        aggregator: a :class:`~zo_byzantine.Rule` (``rule(vectors, ctx) -> Aggregation``) used instead of
            ``args.aggregator``, behind ``args.pre_aggregators``; ``args.aggregator_kwargs`` must then be empty.
        attack: an :class:`~zo_byzantine.Attack` (``attack(honest, own, rule, ctx) -> AttackOutput``) used instead
            of ``args.attack``; ``args.attack_kwargs`` must then be empty.
    """

    def __init__(self, *args, aggregator=None, attack=None, **kwargs):
        super().__init__(*args, **kwargs)
        zo = self.args
        if not isinstance(zo, ZOByzantineArguments):
            raise TypeError(f"ZOByzantineTrainer needs ZOByzantineArguments, got {type(zo).__name__}.")
        if zo.n_gpu > 1:
            raise ValueError(
                "ZOByzantineTrainer uses one device per process: launch one process per GPU "
                "(accelerate launch / torchrun) instead of DataParallel (n_gpu > 1)."
            )
        if (zo.clients_per_round or zo.num_clients) < zo.world_size:
            raise ValueError(
                f"clients_per_round={zo.clients_per_round or zo.num_clients} must be >= the number of "
                f"processes ({zo.world_size}): each process evaluates a share of the clients."
            )
        objects = ((aggregator, zo.aggregator_kwargs, "aggregator"), (attack, zo.attack_kwargs, "attack"))
        for given, kwargs, name in objects:
            if given is not None and kwargs:
                raise ValueError(f"{name}_kwargs={kwargs!r} would be ignored: an {name} object was passed to the "
                                 "trainer (configure the object instead).")
        self.aggregator = build_aggregator(aggregator or zo.aggregator, zo.pre_aggregators, **zo.aggregator_kwargs)
        check_sizing(zo, self.aggregator)  # also for a rule object passed here
        self.attack = build_attack(attack or zo.attack, **zo.attack_kwargs)
        if type(self).compute_loss is not Trainer.compute_loss and type(self).per_example_losses is \
                ZOByzantineTrainer.per_example_losses:
            raise TypeError(
                f"{type(self).__name__} overrides compute_loss, which the rounds cannot use: a round needs every "
                "client's per-example losses, not one batch loss. Override per_example_losses(model, inputs) -> "
                "(loss sums, counts) per example instead (evaluate keeps using compute_loss)."
            )
        # data-dependent checks now, before any evaluation or training: partition, labels, batch vs client data
        self.federation: Federation | None = None
        self._partitioned = None  # the dataset self.federation partitions
        if self.train_dataset is not None:
            self.federation, self._partitioned = build_federation(zo, self.train_dataset), self.train_dataset
        check_label_flipping(self.attack, self.model, self.train_dataset)
        self.table: ParameterTable | None = None
        self.zo_optimizer: ZOOptimizer | None = None
        self.server: Server | None = None
        self.ledger: Ledger | None = None
        self.forward_per_example = PerExampleForward()
        self.schedule = Schedule(zo.zo_schedule, zo.zo_cache_budget_gb)
        self._checked_reach = False
        self._window = self._empty_window()
        self._run_loss = {"loss_sum": 0.0, "loss_count": 0}  # for train_loss: NaN, not 0, if no round computed one
        self._drawn_at_log = COUNTER.drawn

    # ----- set-up: optimizer, clients' data -------------------------------------------------

    def create_optimizer(self, model=None):
        """A :class:`ZOOptimizer` over the trainable parameters (decay groups as ``Trainer``)."""
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            self.table = ParameterTable(opt_model, build_directions(self.args.zo_generator, self.args.zo_distribution))
            decay = set(self.get_decay_parameter_names(opt_model))
            names = self.table.names
            groups = [
                {"params": [p for n, p in zip(names, self.table.params, strict=True) if (n in decay) == wanted],
                 "weight_decay": self.args.weight_decay if wanted else 0.0}
                for wanted in (True, False)
            ]
            zo = self.args
            check_dense_memory(zo, self.table.numel)
            self.optimizer = ZOOptimizer(
                self.table,
                [g for g in groups if g["params"]],
                lr=zo.learning_rate,
                server=zo.server_optimizer,
                local_lr=zo.local_learning_rate if zo.local_learning_rate is not None else zo.learning_rate,
                betas=tuple(zo.server_betas),
                eps=zo.server_eps,
                v0=zo.server_v0,
            )
        if not isinstance(self.optimizer, ZOOptimizer):
            raise TypeError(
                f"ZOByzantineTrainer applies its updates with ZOOptimizer, got {type(self.optimizer).__name__}."
            )
        self.zo_optimizer, self.table = self.optimizer, self.optimizer.table
        self.server = Server(self.args.protocol_settings(), self.aggregator, self.table, self.attack)
        if self.ledger is None:
            self.ledger = Ledger(self.zo_optimizer)
        return self.optimizer

    def get_train_dataloader(self) -> DataLoader:
        """One batch per round: ``per_device_train_batch_size`` examples of every participating client."""
        if self.train_dataset is None:
            raise ValueError("ZOByzantineTrainer: training requires a train_dataset.")
        dataset = self.train_dataset
        if self.federation is None or self._partitioned is not dataset:
            self.federation, self._partitioned = build_federation(self.args, dataset), dataset
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        sampler = FederatedBatchSampler(self.federation, self.args.process_index, self.args.world_size)
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
        )
        prepared = self.accelerator.prepare(loader)
        # the sampler already gives each process its share of the clients: make accelerate's shard a passthrough
        shard = getattr(prepared, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return prepared

    # ----- one round --------------------------------------------------------------------------

    def per_example_losses(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The rounds' loss: per example, ``(sum of token losses, token count)``; override to change the loss
        the clients minimise (``compute_loss`` gives one number per batch, which cannot be split by client)."""
        return self.forward_per_example(model, inputs)

    def get_total_train_batch_size(self, args) -> int:
        """Examples per round: ``B`` for every participating client (throughput figures count them all)."""
        return args.per_device_train_batch_size * (args.clients_per_round or args.num_clients)

    def round_clients(self, model, inputs: dict, num_clients: int, cache: dict | None = None) -> BatchedClients:
        """This process's participants of a round, stacked in ``inputs``, as the client role evaluates them."""
        return BatchedClients(
            model, self.table, inputs, num_clients, self.args.per_device_train_batch_size, self.per_example_losses,
            self.schedule, self.args.zo_forward_batch_size, self.compute_loss_context_manager, cache,
            self.args.zo_direction_batch_size, self.args.zo_group_by_length,
        )

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One federated round (SPEC 1.4, 1.5, 8); the update is staged for ``optimizer.step()``."""
        zo, t = self.args, self.state.global_step
        inputs = self._prepare_inputs(inputs)
        model = self.accelerator.unwrap_model(model)  # no DDP: processes exchange per-client scalars, not grads
        participants = self.federation.participants(t)
        byzantine = torch.as_tensor(self.federation.is_byzantine[participants])
        local = self.federation.share(zo.process_index, zo.world_size)  # this process's clients
        ids = participants[local]
        if self.attack.flips_labels and byzantine[local].any():
            rows = byzantine[local].to(zo.device).repeat_interleave(zo.per_device_train_batch_size)
            inputs = flip_labels(inputs, rows, self.attack.num_classes or model_num_labels(model))
        model.eval()  # the clients' forwards run without dropout, as MeZO's
        lr = self.zo_optimizer.learning_rate()
        local_lr = zo.local_learning_rate if zo.local_learning_rate is not None else lr
        plan = self.server.plan(t, participants, local_lr)
        rows = zo.per_device_train_batch_size * (1 if plan.per_client else len(ids))  # per-client: client by client
        chunks = forward_chunks(rows, zo.zo_forward_batch_size, zo.per_device_train_batch_size, zo.zo_group_by_length)
        schedule = self.schedule.resolve(self.table, plan.num_directions(len(ids)), chunks)
        cache = {} if schedule == "cached" else None  # the round's directions
        sizes = [len(self.federation.partitions[c]) for c in ids]
        with torch.no_grad():
            reports = client_reports(plan, self.round_clients(model, inputs, len(ids), cache), self.table, ids, sizes)
            downlink = self.server.aggregate(plan, self.gather_reports(plan, reports), lr, byzantine)
        self.zo_optimizer.stage_downlink(downlink, cache)
        self.ledger.append(downlink)
        self.record(downlink)
        if downlink.skipped:
            logger.warning("Round %d skipped (%s); the model is left unchanged.", t, downlink.skipped)
        elif not self._checked_reach and self.table.reached:
            self._checked_reach = True
            missing = self.table.unreached()
            if missing:
                logger.warning("%d trainable parameters were never reached by a module forward, so their zeroth-order "
                               "estimate is zero (unused, or read outside their module's forward): %s",
                               len(missing), ", ".join(missing[:10]))
        return torch.tensor(downlink.loss, dtype=torch.float32, device=zo.device)

    def gather_reports(self, plan: Plan, reports: list[Report]) -> list[Report]:
        """Every process's reports, in participant order (identity in one process), so that every process
        aggregates the same reports and applies the same update."""
        world = self.args.world_size
        if world == 1:
            return reports
        shares = [self.federation.share(r, world) for r in range(world)]
        gathered = []
        for rows in (torch.stack([r.scalars for r in reports]), torch.tensor([r.loss for r in reports]).double()):
            padded = self.accelerator.pad_across_processes(rows.to(self.args.device), dim=0)  # to the largest share
            every = self.accelerator.gather(padded).view(world, len(padded), *rows.shape[1:])
            gathered.append(torch.cat([every[r, : s.stop - s.start] for r, s in enumerate(shares)]).cpu())
        scalars, losses = gathered
        return [
            Report(plan.round, c, scalars[i], float(losses[i]), len(self.federation.partitions[c]))
            for i, c in enumerate(plan.participants)
        ]

    @staticmethod
    def _empty_window() -> dict:
        return {**dict.fromkeys(WINDOW_KEYS, 0), "diagnostics": {}}

    def record(self, downlink: Downlink) -> None:
        """Add a round to the logging window: skipped, non-finite values, rejected reports, the diagnostics of
        the rule and the attack (sums and counts per name)."""
        window = self._window
        window["rounds"] += 1
        window["skipped_rounds"] += int(bool(downlink.skipped))
        window["nonfinite_values"] += downlink.nonfinite
        window["rejected_reports"] += downlink.rejected
        if math.isfinite(downlink.loss):  # the honest loss, also of a skipped round when it was computed
            for totals in (window, self._run_loss):
                totals["loss_sum"] += downlink.loss
                totals["loss_count"] += 1
        if downlink.skipped:
            return
        for found in downlink.diagnostics:
            for name, value in found.items():
                total = window["diagnostics"].setdefault(name, [0.0, 0])
                total[0] += value
                total[1] += 1

    # ----- logs, communication, checkpoints ---------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training logs: honest loss, communication, skipped rounds, non-finite values; no ``grad_norm``."""
        logs.pop("grad_norm", None)
        window = self._window
        if "train_loss" in logs:
            logs["train_loss"] = self.mean_loss(self._run_loss)
        if "loss" in logs and window["rounds"] and self.table is not None:
            logs["loss"] = self.mean_loss(window)  # the Trainer's would count skipped rounds as 0
            logs.update(self.server.communication(self.federation.clients_per_round, self.state.global_step))
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
            logs["generator_passes_per_round"] = (COUNTER.drawn - self._drawn_at_log) / (
                window["rounds"] * self.table.numel
            )
            self._window = self._empty_window()
            self._drawn_at_log = COUNTER.drawn
        super().log(logs, start_time)
        if "loss" in logs:  # the progress bar shows rounds with the honest loss
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                    callback.training_bar.set_postfix(honest_loss=f"{logs['loss']:.4f}", refresh=False)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A model that is not a ``PreTrainedModel`` (e.g. a wrapper around one with tied weights) is saved with
        ``safetensors.torch.save_model``, which stores shared tensors once (``save_file`` refuses them)."""
        model = self.accelerator.unwrap_model(self.model)
        if state_dict is not None or isinstance(model, PreTrainedModel) or hasattr(model, "peft_config"):
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            safetensors.torch.save_model(model, os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as ``Trainer`` does, and the ledger beside it."""
        super().save_model(output_dir, _internal_call)
        if self.ledger is not None and self.args.should_save:
            self.ledger.save(output_dir or self.args.output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Resume: the checkpoint's ledger continues (it holds the run's start fingerprint and rounds 0..t-1);
        a checkpoint without one is refused, since the final ledger could not replay the run."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.ledger is None:
            return
        if not os.path.isfile(os.path.join(checkpoint, LEDGER_NAME)):
            raise LedgerError(
                f"Checkpoint {checkpoint!r} has no {LEDGER_NAME}: resuming would write a ledger that cannot replay "
                "the run. Restore the file from the run's output directory (or start a new run)."
            )
        self.ledger.continue_from(Ledger.read(checkpoint))
        done = [r["loss"] for r in self.ledger.rounds if r.get("loss") is not None]  # train_loss as uninterrupted
        self._run_loss = {"loss_sum": float(sum(done)), "loss_count": len(done)}
        if len(self.ledger.rounds) != self.state.global_step:
            raise LedgerError(
                f"Checkpoint {checkpoint!r}: its ledger holds {len(self.ledger.rounds)} rounds, its trainer state "
                f"{self.state.global_step}."
            )

    def create_model_card(self, *args, **kwargs) -> None:
        """The Trainer's card, with the optimizer and batch lines made true and the federation described."""
        super().create_model_card(*args, **kwargs)
        path = os.path.join(self.args.output_dir, "README.md")
        if self.is_world_process_zero() and os.path.isfile(path) and self.server is not None:
            m = self.federation.clients_per_round if self.federation else self.args.num_clients
            digest = self.ledger.to_dict()["digest"] if self.ledger is not None else "none"
            rewrite_card(path, self.args, self.state.global_step, self.server.scalars_per_client(m)[0],
                         self.table.numel, digest)

    @staticmethod
    def mean_loss(totals: dict) -> float:
        return totals["loss_sum"] / totals["loss_count"] if totals["loss_count"] else math.nan

    def _refuse_finished_checkpoint(self, resume_from_checkpoint) -> None:
        """A checkpoint already at ``max_steps`` leaves nothing to train, but the Trainer's loop would still run one
        more round before it checks (a re-run of a finished job would add a round each time): refused instead."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True and os.path.isdir(self.args.output_dir):  # the Trainer's "the last one"
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if not isinstance(checkpoint, str) or self.args.max_steps <= 0:
            return
        try:
            with open(os.path.join(checkpoint, "trainer_state.json")) as f:
                step = json.load(f)["global_step"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # the Trainer's own loading reports what is wrong with it
        if isinstance(step, int) and step >= self.args.max_steps:
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: the checkpoint is at round {step}, "
                             f"max_steps={self.args.max_steps}; nothing is left to train (accepted: a checkpoint "
                             f"before round max_steps, or a larger max_steps to continue the run).")

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._refuse_finished_checkpoint(resume_from_checkpoint)
        self._run_loss = {"loss_sum": 0.0, "loss_count": 0}
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        best = self.state.best_model_checkpoint
        if self.args.load_best_model_at_end and best and os.path.isfile(os.path.join(best, LEDGER_NAME)):
            self.ledger.continue_from(Ledger.read(best))  # the loaded weights' ledger, not the last round's
        if self.ledger is not None and self.args.should_save:
            self.ledger.save(self.args.output_dir)
        loss = self.mean_loss(self._run_loss)
        return output._replace(training_loss=loss, metrics={**output.metrics, "train_loss": loss})


__all__ = ["ZOByzantineTrainer"]

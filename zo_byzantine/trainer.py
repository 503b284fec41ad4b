"""``ZOByzantineTrainer``: a drop-in ``Trainer`` whose optimisation step is one federated round.

Hugging Face glue only: it drives the protocol's two roles in one process (SPEC 8). One round:

    plan = server.plan(t, participants, local lr)
    reports = client_reports(plan, the participants' examples in one batch)   # client role, batched
    downlink = server.aggregate(plan, reports, lr, byzantine mask)             # attack (simulation), rule
    optimizer.step(): w <- w - lr * sum_k c_k z_k                              # from the downlink
"""

from __future__ import annotations

import logging
import os

import torch
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback

from .aggregators import build_aggregator
from .arguments import ZOByzantineArguments, check_dense_memory, check_sizing
from .attacks import build_attack
from .client import client_reports
from .federation import FederatedBatchSampler, Federation, dataset_labels, partition_dataset
from .ledger import LEDGER_NAME, Ledger
from .losses import PerExampleForward
from .messages import Downlink, Plan, Report
from .optim import ZOOptimizer
from .perturbation import COUNTER, ParameterTable
from .server import Server
from .simulation import BatchedClients, Schedule, flip_labels, model_num_labels

logger = logging.getLogger(__name__)

WINDOW_KEYS = ("rounds", "skipped_rounds", "nonfinite_values", "rejected_reports")
PER_APPLIED_ROUND = ("aggregate_shift", "honest_mean_norm")  # logged as means over applied rounds
LOG_NAMES = {"omega": "attack_omega"}  # averaged over the uplinks that reported it; other diagnostics summed


class ZOByzantineTrainer(Trainer):
    """``Trainer`` running FedByZO rounds. Same constructor, plus optional rule/attack objects.

    Args:
        aggregator: a rule object ``rule(Tensor[n, nu]) -> Tensor[nu]`` used instead of ``args.aggregator``.
        attack: an attack object used instead of ``args.attack``.
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
        self.aggregator = build_aggregator(aggregator or zo.aggregator, zo.pre_aggregators, **zo.aggregator_kwargs)
        check_sizing(zo, self.aggregator)  # also for a rule object passed here
        self.attack = build_attack(attack or zo.attack, **zo.attack_kwargs)
        self.federation: Federation | None = None
        self.table: ParameterTable | None = None
        self.zo_optimizer: ZOOptimizer | None = None
        self.server: Server | None = None
        self.ledger: Ledger | None = None
        self.forward_per_example = PerExampleForward()
        self.schedule = Schedule(zo.zo_schedule)
        self._checked_reach = False
        self._window = self._empty_window()
        self._drawn_at_log = COUNTER.drawn

    # ----- set-up: optimizer, clients' data -------------------------------------------------

    def create_optimizer(self, model=None):
        """A :class:`ZOOptimizer` over the trainable parameters (decay groups as ``Trainer``)."""
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            self.table = ParameterTable(opt_model)
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

    def build_federation(self, dataset) -> Federation:
        """Partition ``dataset`` over the clients (seeded by ``zo_seed``)."""
        zo = self.args
        labels = None if zo.partition == "iid" else dataset_labels(dataset)
        parts = partition_dataset(
            zo.partition, len(dataset), zo.num_clients, zo.zo_seed, labels, zo.dirichlet_alpha, zo.min_client_examples
        )
        return Federation(parts, zo.per_device_train_batch_size, zo.num_byzantine, zo.zo_seed, zo.clients_per_round,
                          zo.byzantine_selection)

    def get_train_dataloader(self) -> DataLoader:
        """One batch per round: ``per_device_train_batch_size`` examples of every participating client."""
        if self.train_dataset is None:
            raise ValueError("ZOByzantineTrainer: training requires a train_dataset.")
        dataset = self.train_dataset
        self.federation = self.build_federation(dataset)
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

    def round_clients(self, model, inputs: dict, num_clients: int, cache: dict | None = None) -> BatchedClients:
        """This process's participants of a round, stacked in ``inputs``, as the client role evaluates them."""
        return BatchedClients(
            model, self.table, inputs, num_clients, self.args.per_device_train_batch_size, self.forward_per_example,
            self.schedule, self.args.zo_forward_batch_size, self.compute_loss_context_manager, cache,
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
        cache = {} if self.schedule.name == "cached" else None  # the round's directions (nu d floats)
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
        width = max(s.stop - s.start for s in shares)
        device = self.args.device
        gathered = []
        for rows in (torch.stack([r.scalars for r in reports]), torch.tensor([r.loss for r in reports]).double()):
            padded = torch.zeros((width, *rows.shape[1:]), dtype=rows.dtype, device=device)
            padded[: len(rows)] = rows
            every = self.accelerator.gather(padded).view(world, width, *rows.shape[1:])
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
        if "loss" in logs and window["rounds"] and self.table is not None:
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

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as ``Trainer`` does, and the ledger beside it."""
        super().save_model(output_dir, _internal_call)
        if self.ledger is not None and self.args.should_save:
            self.ledger.save(output_dir or self.args.output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.ledger is not None:
            if os.path.isfile(os.path.join(checkpoint, LEDGER_NAME)):
                self.ledger.rounds = Ledger.read(checkpoint)["rounds"]

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self.ledger is not None and self.args.should_save:
            self.ledger.save(self.args.output_dir)
        return output


__all__ = ["ZOByzantineTrainer"]

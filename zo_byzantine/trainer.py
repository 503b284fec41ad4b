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
from transformers import PreTrainedModel, Trainer

from . import checkpoints, preflight
from .arguments import ZOByzantineArguments
from .attacks import flip_labels, model_num_labels
from .batched_clients import BatchedClients
from .card import rewrite_card
from .checks import build_federation, check_dense_memory
from .chunks import forward_chunks
from .client import client_reports
from .directions import build_directions
from .federation import FederatedBatchSampler
from .ledger import Ledger
from .loss_routes import training_data
from .messages import Plan, Report
from .offload import check_offload_settings
from .optim import ZOOptimizer
from .perturbation import ParameterTable
from .server import Server

logger = logging.getLogger(__name__)


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
        if not isinstance(self.args, ZOByzantineArguments):
            raise TypeError(f"ZOByzantineTrainer needs ZOByzantineArguments, got {type(self.args).__name__}.")
        if type(self).compute_loss is not Trainer.compute_loss and not preflight.overrides_per_example_losses(self):
            raise TypeError(
                f"{type(self).__name__} overrides compute_loss, which the rounds cannot use: a round needs every "
                "client's per-example losses, not one batch loss. Override per_example_losses(model, inputs) -> "
                "(loss sums, counts) per example instead (evaluate keeps using compute_loss), or pass "
                "compute_loss_func (split per example)."
            )
        # rule, attack, partition, loss route (refused now if the rounds cannot split it), callbacks; before any work
        check_offload_settings(self.args, self.model)  # streamed weights: what a round cannot run within them
        preflight.set_up(self, aggregator, attack)

    def _hp_search_setup(self, trial) -> None:
        """A trial's settings get the constructor's validation and construction (:func:`preflight.apply_trial`)."""
        super()._hp_search_setup(trial)
        preflight.apply_trial(self, trial)

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
                rounding=zo.update_rounding,
            )
        if not isinstance(self.optimizer, ZOOptimizer):
            raise TypeError(
                f"ZOByzantineTrainer applies its updates with ZOOptimizer, got {type(self.optimizer).__name__}."
            )
        self.zo_optimizer, self.table = self.optimizer, self.optimizer.table
        self.server = Server(self.args.protocol_settings(), self.aggregator, self.table, self.attack)
        if self.ledger is None:
            self.ledger = Ledger(self.zo_optimizer, protocol=checkpoints.run_protocol(self))
        return self.optimizer

    def get_train_dataloader(self) -> DataLoader:
        """One batch per round: ``per_device_train_batch_size`` examples of every participating client."""
        if self.train_dataset is None:
            raise ValueError("ZOByzantineTrainer: training requires a train_dataset.")
        dataset = self.train_dataset
        if self.federation is None or self._partitioned is not dataset:
            self.federation, self._partitioned = build_federation(self.args, dataset), dataset
        dataset, collator = training_data(self, dataset)
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
        self.round_log.record(downlink)
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

    # ----- logs, communication, checkpoints ---------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training logs: honest loss, communication, skipped rounds, non-finite values; no ``grad_norm``."""
        logs.pop("grad_norm", None)
        if "train_loss" in logs:
            logs["train_loss"] = self.round_log.run_mean()
        if "loss" in logs and self.table is not None:
            communication = self.server.communication(self.federation.clients_per_round, self.state.global_step) \
                if self.round_log.window["rounds"] else {}
            logs.update(self.round_log.window_logs(communication, self.table.numel))
        super().log(logs, start_time)  # the progress bar shows it: callbacks.HonestLossProgress

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A model that is not a ``PreTrainedModel`` is saved by :func:`checkpoints.save_plain_model` (shared
        tensors once)."""
        model = self.accelerator.unwrap_model(self.model)
        if state_dict is not None or isinstance(model, PreTrainedModel) or hasattr(model, "peft_config"):
            return super()._save(output_dir, state_dict)
        if self.args.should_save:
            checkpoints.save_plain_model(model, output_dir if output_dir is not None else self.args.output_dir,
                                         self.processing_class)

    def _issue_warnings_after_load(self, load_result) -> None:
        """Trainer's warning for keys missing from a loaded checkpoint, without the tied keys that were loaded
        through the tensor they share (:func:`checkpoints.missing_untied`)."""
        model = self.accelerator.unwrap_model(self.model)
        missing = checkpoints.missing_untied(model, load_result.missing_keys)
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as ``Trainer`` does, and the ledger beside it."""
        super().save_model(output_dir, _internal_call)
        if self.ledger is not None and self.args.should_save:
            self.ledger.save(output_dir or self.args.output_dir, weights=self.table)

    def _save_checkpoint(self, model, trial) -> None:
        """A checkpoint complete or absent: written aside, then renamed (:func:`checkpoints.staged_checkpoint`)."""
        with checkpoints.staged_checkpoint(self, trial):
            super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Resume: the checkpoint's ledger continues (:func:`checkpoints.resume_ledger`)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.ledger is not None:
            self.round_log.restart(checkpoints.resume_ledger(self, checkpoint))

    def create_model_card(self, *args, **kwargs) -> None:
        """The Trainer's card, with the optimizer and batch lines made true and the federation described."""
        super().create_model_card(*args, **kwargs)
        path = os.path.join(self.args.output_dir, "README.md")
        if self.is_world_process_zero() and os.path.isfile(path) and self.server is not None:
            m = self.federation.clients_per_round if self.federation else self.args.num_clients
            digest = self.ledger.to_dict()["digest"] if self.ledger is not None else "none"
            rounds = len(self.ledger.rounds) if self.ledger is not None else self.state.global_step  # the weights'
            rewrite_card(path, self.args, rounds, self.server.scalars_per_client(m)[0], self.table.numel, digest,
                         run_rounds=self.state.global_step)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        resume_from_checkpoint = checkpoints.prepare_resume(self, resume_from_checkpoint)  # before any work
        self.round_log.restart()
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        if self.args.load_best_model_at_end:
            checkpoints.continue_from_best(self.ledger, self.state.best_model_checkpoint)
        if self.ledger is not None and self.args.should_save:
            self.ledger.save(self.args.output_dir, weights=self.table)
        loss = self.round_log.run_mean()
        return output._replace(training_loss=loss, metrics={**output.metrics, "train_loss": loss})


__all__ = ["ZOByzantineTrainer"]

"""``ZOByzantineTrainer``: a drop-in ``Trainer`` whose optimisation step is one federated round.

Hugging Face glue only; the method lives in ``perturbation``, ``estimators``, ``federation``,
``rounds``, ``attacks``, ``aggregators``, ``optim`` and ``ledger``. One round (SPEC 1.4), K = 1:

    batch -> per-client losses at w +- mu z_r (all clients in one batched forward per sign)
          -> v_i in R^nu -> Byzantine clients replace theirs -> R_t = rule({v_i})
          -> optimizer.step(): w <- w - lr * sum_r R_t[r] z_r
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback

from .aggregators import build_aggregator
from .arguments import ZOByzantineArguments
from .attacks import build_attack
from .estimators import ESTIMATORS
from .federation import FederatedBatchSampler, Federation, partition_dataset
from .ledger import LEDGER_NAME, Ledger
from .losses import PerExampleForward, client_losses, per_example_loss
from .optim import ZOOptimizer
from .perturbation import COUNTER, ParameterTable, antithetic, perturbed
from .rounds import Protocol, RoundResult, SkipRound, run_round, uplink_downlink_scalars

logger = logging.getLogger(__name__)

BYTES_PER_SCALAR = 4  # scalars travel as float32
WINDOW_KEYS = (
    "rounds",
    "skipped_rounds",
    "nonfinite_values",
    "aggregate_shift",
    "honest_mean_norm",
    "omega",
    "omega_rounds",
    "byzantine_values_kept",
)


def _dataset_labels(dataset) -> np.ndarray | None:
    for column in ("labels", "label"):
        names = getattr(dataset, "column_names", None)
        if names is not None and column in names:
            return np.asarray(dataset[column])
    try:
        first = dataset[0]
    except (TypeError, IndexError, KeyError):
        return None
    for column in ("labels", "label"):
        if isinstance(first, dict) and column in first:
            return np.asarray([int(dataset[i][column]) for i in range(len(dataset))])
    return None


class RoundClients:
    """The round's participants as ``rounds.run_round`` sees them: losses and gradients at given terms."""

    def __init__(self, trainer: ZOByzantineTrainer, model, inputs: dict, participants: np.ndarray):
        args = trainer.args
        self.trainer, self.model, self.inputs = trainer, model, inputs
        self.local = trainer.federation.share(args.process_index, args.world_size)  # this process's clients
        self.shares = [trainer.federation.share(r, args.world_size) for r in range(args.world_size)]
        self.m, self.batch = len(participants[self.local]), args.per_device_train_batch_size
        self.sizes = np.array([len(trainer.federation.partitions[c]) for c in participants], dtype=np.float64)
        self.rows = torch.arange(self.m, device=args.device).repeat_interleave(self.batch)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-client rows of every process, in participant order (identity in one process)."""
        if len(self.shares) == 1:
            return rows
        width = max(s.stop - s.start for s in self.shares)
        padded = torch.zeros((width, *rows.shape[1:]), dtype=rows.dtype, device=self.trainer.args.device)
        padded[: len(rows)] = rows
        gathered = self.trainer.accelerator.gather(padded).view(len(self.shares), width, *rows.shape[1:])
        return torch.cat([gathered[r, : s.stop - s.start] for r, s in enumerate(self.shares)]).cpu()

    def client_inputs(self, i: int) -> dict:
        total = self.m * self.batch
        return {
            k: v[i * self.batch : (i + 1) * self.batch] if torch.is_tensor(v) and v.shape[:1] == (total,) else v
            for k, v in self.inputs.items()
        }

    def losses(self, terms_per_client: list, cache: dict | None = None) -> torch.Tensor:
        """One batched evaluation when all clients share their terms, else one per client (float64, on CPU)."""
        first = terms_per_client[0]
        if all(terms == first for terms in terms_per_client):
            return self.trainer.client_losses(self.model, self.inputs, self.rows, self.m, first, cache).cpu()
        one = torch.zeros(self.batch, dtype=torch.long, device=self.rows.device)
        each = [
            self.trainer.client_losses(self.model, self.client_inputs(i), one, 1, terms, cache)
            for i, terms in enumerate(terms_per_client)
        ]
        return torch.cat(each).cpu()

    def loss_pair(self, offsets: list, seeds: list[int], mu: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Losses at ``w_i + offset_i +- mu z_i`` with the trainer's schedule (``zo_schedule``)."""
        schedule = self.trainer.zo_schedule
        if schedule == "auto":
            schedule = self.trainer.choose_schedule(self, offsets, seeds, mu)
        if schedule == "antithetic":
            shared = all(o == offsets[0] for o in offsets) and len(set(seeds)) == 1
            if shared:
                return self.trainer.client_losses_antithetic(
                    self.model, self.inputs, self.rows, self.m, offsets[0], seeds[0], mu
                )
            one = torch.zeros(self.batch, dtype=torch.long, device=self.rows.device)
            pairs = [
                self.trainer.client_losses_antithetic(self.model, self.client_inputs(i), one, 1, o, s, mu)
                for i, (o, s) in enumerate(zip(offsets, seeds, strict=True))
            ]
            return torch.cat([p for p, _ in pairs]), torch.cat([m for _, m in pairs])
        cache = self.trainer.round_cache  # "cached": z drawn once, kept for the -mu forward and the update
        plus = self.losses([o + [(s, mu)] for o, s in zip(offsets, seeds, strict=True)], cache)
        minus = self.losses([o + [(s, -mu)] for o, s in zip(offsets, seeds, strict=True)], cache)
        return plus, minus

    def gradients(self, terms_per_client: list):
        """Each client's backprop gradient of its loss at ``w + sum terms_i`` (one backward per client)."""
        table, grads, losses = self.trainer.table, [], []
        for i, terms in enumerate(terms_per_client):
            chunk = self.client_inputs(i)
            with torch.enable_grad(), perturbed(table, terms), self.trainer.compute_loss_context_manager():
                sums, counts = per_example_loss(self.model, self.model(**chunk), chunk.get("labels"))
                loss = sums.sum() / counts.sum()
                found = torch.autograd.grad(loss, table.params, allow_unused=True)
            grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(table.params, found, strict=True)])
            losses.append(loss.detach())
        return grads, torch.stack(losses).double().cpu()

    def weights(self) -> np.ndarray:
        """Data-size weights ``|D_i| / sum_j |D_j|`` over the participants (FedES)."""
        return self.sizes / self.sizes.sum()


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
        n, b = zo.num_clients, zo.num_byzantine
        self.aggregator = build_aggregator(
            aggregator or zo.aggregator, n, b, zo.pre_aggregators, **zo.aggregator_kwargs
        )
        self.attack = build_attack(attack or zo.attack, n, b, **zo.attack_kwargs)
        self.estimator = ESTIMATORS.get(zo.estimator)(zo.zo_eps)
        self.federation: Federation | None = None
        self.table: ParameterTable | None = None
        self.zo_optimizer: ZOOptimizer | None = None
        self.ledger: Ledger | None = None
        self.forward_per_example = PerExampleForward()
        self.zo_schedule = zo.zo_schedule
        self.round_cache: dict | None = None
        self._checked_reach = False
        self._window = dict.fromkeys(WINDOW_KEYS, 0.0)
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
                {
                    "params": [p for n, p in zip(names, self.table.params, strict=True) if n in decay],
                    "weight_decay": self.args.weight_decay,
                },
                {
                    "params": [p for n, p in zip(names, self.table.params, strict=True) if n not in decay],
                    "weight_decay": 0.0,
                },
            ]
            zo = self.args
            self.check_dense_memory()
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
        if self.ledger is None:
            self.ledger = Ledger(self.zo_optimizer)
        return self.optimizer

    def check_dense_memory(self) -> None:
        """R^d aggregation (FedAvg, FedZO) holds n x d float64 values: refuse before training if they do not fit."""
        zo = self.args
        if zo.estimator != "first_order" and zo.aggregation_space != "parameter":
            return
        need = 3 * zo.num_clients * self.table.numel * 8  # vectors, attacked copy, reconstruction
        limit = zo.dense_memory_limit_gb
        if limit is None:
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4 / 2**30
        if need > limit * 2**30:
            raise ValueError(
                f"Aggregating in R^d (estimator={zo.estimator!r}, aggregation_space={zo.aggregation_space!r}) needs "
                f"about {need / 2**30:.1f} GiB for n={zo.num_clients} x d={self.table.numel}; "
                f"dense_memory_limit_gb={limit:.1f}. "
                "Use fewer clients, a smaller model (or a PEFT adapter), or raise dense_memory_limit_gb."
            )

    def build_federation(self, dataset) -> Federation:
        """Partition ``dataset`` over the clients (seeded by ``zo_seed``)."""
        zo = self.args
        labels = None if zo.partition == "iid" else _dataset_labels(dataset)
        parts = partition_dataset(
            zo.partition, len(dataset), zo.num_clients, zo.zo_seed, labels, zo.dirichlet_alpha, zo.min_client_examples
        )
        return Federation(
            parts,
            zo.per_device_train_batch_size,
            zo.num_byzantine,
            zo.zo_seed,
            zo.clients_per_round,
            zo.byzantine_selection,
        )

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

    def _chunks(self, inputs: dict, size: int):
        total = next(v.shape[0] for v in inputs.values() if torch.is_tensor(v))
        size = size or total
        for start in range(0, total, size):
            yield {
                k: v[start : start + size] if torch.is_tensor(v) and v.shape[:1] == (total,) else v
                for k, v in inputs.items()
            }

    def client_losses(self, model, inputs, client_of_example, num_clients, terms, cache=None) -> torch.Tensor:
        """Loss of each client at ``w + sum_k c_k z_k``: batched forwards over all clients' examples."""
        sums, counts = [], []
        with perturbed(self.table, terms, cache), self.compute_loss_context_manager():
            for chunk in self._chunks(inputs, self.args.zo_forward_batch_size):
                s, c = self.forward_per_example(model, chunk)
                sums.append(s)
                counts.append(c)
        return client_losses(torch.cat(sums), torch.cat(counts), client_of_example, num_clients)

    def client_losses_antithetic(self, model, inputs, client_of_example, num_clients, base, seed, mu):
        """Losses at ``w + base + mu z`` and ``w + base - mu z`` from forwards of doubled batches ``[x; x]``."""
        halves = [[], [], [], []]  # plus sums, plus counts, minus sums, minus counts
        for chunk in self._chunks(inputs, self.args.zo_forward_batch_size):
            n = next(v.shape[0] for v in chunk.values() if torch.is_tensor(v))
            doubled = {k: torch.cat([v, v]) if torch.is_tensor(v) and v.shape[:1] == (n,) else v
                       for k, v in chunk.items()}
            with antithetic(self.table, base, seed, mu, 2 * n), self.compute_loss_context_manager():
                s, c = self.forward_per_example(model, doubled)
            for store, value in zip(halves, (s[:n], c[:n], s[n:], c[n:]), strict=True):
                store.append(value)
        plus = client_losses(torch.cat(halves[0]), torch.cat(halves[1]), client_of_example, num_clients)
        minus = client_losses(torch.cat(halves[2]), torch.cat(halves[3]), client_of_example, num_clients)
        return plus.cpu(), minus.cpu()

    def choose_schedule(self, clients, offsets, seeds, mu) -> str:
        """``zo_schedule="auto"``: use the antithetic forward if it gives the two-forward losses (checked once)."""
        reference = clients.losses([o + [(s, mu)] for o, s in zip(offsets, seeds, strict=True)])
        self.zo_schedule = "antithetic"
        try:
            candidate = clients.loss_pair(offsets, seeds, mu)[0]
            agrees = torch.allclose(candidate, reference, rtol=1e-4, atol=1e-6)
        except (TypeError, RuntimeError, ValueError) as err:
            agrees, reference = False, err
        if not agrees:
            logger.warning(
                "The antithetic (doubled-batch) forward does not reproduce two plain forwards for this "
                "model (%s); using zo_schedule='two_forwards'.",
                reference,
            )
            self.zo_schedule = "two_forwards"
        return self.zo_schedule

    def protocol(self) -> Protocol:
        zo = self.args
        local_lr = zo.local_learning_rate if zo.local_learning_rate is not None else self.zo_optimizer.learning_rate()
        return Protocol(
            zo.zo_seed,
            zo.num_perturbations,
            zo.local_steps,
            zo.local_update,
            local_lr,
            zo.directions,
            zo.aggregation_space,
        )

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One federated round (SPEC 1.4, 1.5); the update is staged for ``optimizer.step()``."""
        zo, t = self.args, self.state.global_step
        inputs = self._prepare_inputs(inputs)
        participants = self.federation.participants(t)
        batch = next(v.shape[0] for v in inputs.values() if torch.is_tensor(v))
        model = self.accelerator.unwrap_model(model)  # no DDP: processes exchange per-client scalars, not grads
        byzantine = torch.as_tensor(self.federation.is_byzantine[participants])
        clients = RoundClients(self, model, inputs, participants)
        self.round_cache = {} if self.zo_schedule == "cached" else None  # the round's directions (nu d floats)
        if batch != clients.m * zo.per_device_train_batch_size:
            raise RuntimeError(
                f"Round {t}: batch of {batch} rows, expected {clients.m} clients "
                f"x {zo.per_device_train_batch_size} examples."
            )
        local_byzantine = byzantine[clients.local].to(zo.device)
        if getattr(self.attack, "flips_labels", False) and local_byzantine.any():
            rows = local_byzantine.repeat_interleave(zo.per_device_train_batch_size)
            clients.inputs = self.flip_labels(model, inputs, rows)
        model.eval()  # the clients' forwards run without dropout, as MeZO's
        lr = self.zo_optimizer.learning_rate()
        try:
            with torch.no_grad():
                result = run_round(
                    self.protocol(),
                    self.estimator,
                    clients,
                    self.table,
                    t,
                    participants,
                    byzantine,
                    self.attack,
                    self.aggregator,
                    self.set_round,
                )
            self.check_overflow(result, lr)
        except SkipRound as skip:
            logger.warning("Round %d skipped (%s); the model is left unchanged.", t, skip)
            self._window["skipped_rounds"] += 1
            self._window["rounds"] += 1
            self._window["nonfinite_values"] += skip.result.nonfinite
            self.ledger.record(t, [], [], lr, skipped=str(skip))
            loss = skip.result.honest_loss
            return torch.tensor(float("nan") if loss is None else float(loss), device=zo.device)
        self._window["nonfinite_values"] += result.nonfinite
        for aggregate, honest, byz in result.aggregates:
            self.diagnose(aggregate, honest, byz)
        if result.dense is not None:
            self.zo_optimizer.stage_dense(result.dense)
            self.ledger.record(t, [], [], lr, dense=True)
        else:
            self.zo_optimizer.stage(result.terms, self.round_cache)
            self.ledger.record(t, result.seed_tuples, [c for _, c in result.terms], lr)
        self._window["rounds"] += 1
        if not self._checked_reach and self.table.reached:
            self._checked_reach = True
            missing = self.table.unreached()
            if missing:
                logger.warning("%d trainable parameters were never reached by a module forward, so their zeroth-order "
                               "estimate is zero (unused, or read outside their module's forward): %s",
                               len(missing), ", ".join(missing[:10]))
        return result.honest_loss.detach().to(device=zo.device, dtype=torch.float32)

    def set_round(self, key: tuple[int, ...]) -> None:
        """Seeds the round-dependent randomness of the rule (bucketing) and the attack."""
        for part in (self.aggregator, self.attack):
            if hasattr(part, "set_round"):
                part.set_round(key)

    def check_overflow(self, result: RoundResult, lr: float) -> None:
        """Guard: ``lr * size * 10`` (|z| < 10 in practice) above ``sqrt(largest float)`` of the weights' dtype,
        with size ``sum |c_k|`` (seeded update) or ``max |g|`` (dense). No honest update is that large;
        applying it (a non-robust rule fed extreme values) would push the weights towards inf."""
        largest = min(torch.finfo(p.dtype).max for p in self.table.params)
        if result.dense is not None:
            size = max(float(g.abs().max()) for g in result.dense)
        else:
            size = sum(abs(c) for _, c in result.terms)
        if lr * size * 10 >= largest**0.5:
            raise SkipRound("aggregate overflows the parameters' dtype", result)

    def flip_labels(self, model, inputs: dict, rows: torch.Tensor) -> dict:
        """Label flipping on the Byzantine clients' rows: ``y -> C - 1 - y`` (ignored labels kept)."""
        labels = inputs.get("labels")
        if labels is None or labels.dim() != 1:
            raise ValueError("attack='lf' needs class labels of shape [batch] in the inputs.")
        classes = (self.attack.num_classes or getattr(model, "num_labels", None)
                   or getattr(getattr(model, "config", None), "num_labels", None))
        if not classes:
            raise ValueError("attack='lf' needs the number of classes: set attack_kwargs={'num_classes': C}.")
        flipped = torch.where(rows & (labels >= 0), classes - 1 - labels, labels)
        return {**inputs, "labels": flipped}

    def diagnose(self, aggregate: torch.Tensor, honest: torch.Tensor, byzantine: torch.Tensor) -> None:
        """Window sums of ``||R - hbar||``, ``||hbar||``, the attack's omega, CWTM's surviving Byzantine values."""
        window, hbar = self._window, honest.mean(dim=0)
        window["aggregate_shift"] += float((aggregate - hbar).norm())
        window["honest_mean_norm"] += float(hbar.norm())
        omega = getattr(self.attack, "last_omega", None)
        if omega is not None:
            window["omega"] += omega
            window["omega_rounds"] += 1
        kept = getattr(self.aggregator, "last_kept", None)
        if kept is not None and byzantine.any():
            window["byzantine_values_kept"] += int(kept[byzantine.to(kept.device)].sum())

    # ----- logs, communication, checkpoints ---------------------------------------------------

    def communication(self) -> dict[str, float]:
        """Scalars and bytes per client per round, cumulative bytes, beside dense FedAvg (d each way)."""
        d, clients, rounds = self.table.numel, self.federation.clients_per_round, self.state.global_step
        up, down = uplink_downlink_scalars(self.protocol(), self.estimator, d, clients)
        return {
            "uplink_scalars_per_client": up,
            "uplink_bytes_per_client": up * BYTES_PER_SCALAR,
            "downlink_scalars_per_client": down,
            "downlink_bytes_per_client": down * BYTES_PER_SCALAR,
            "fedavg_bytes_per_client": d * BYTES_PER_SCALAR,
            "uplink_bytes_total": rounds * clients * up * BYTES_PER_SCALAR,
            "downlink_bytes_total": rounds * clients * down * BYTES_PER_SCALAR,
            "fedavg_uplink_bytes_total": rounds * clients * d * BYTES_PER_SCALAR,
        }

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training logs: honest loss, communication, skipped rounds, non-finite values; no ``grad_norm``."""
        logs.pop("grad_norm", None)
        window = self._window
        if "loss" in logs and window["rounds"] and self.table is not None:
            logs.update(self.communication())
            applied = max(window["rounds"] - window["skipped_rounds"], 1)
            logs["skipped_rounds"] = int(window["skipped_rounds"])
            logs["nonfinite_values"] = int(window["nonfinite_values"])
            logs["aggregate_shift"] = window["aggregate_shift"] / applied  # mean ||R - hbar||
            logs["honest_mean_norm"] = window["honest_mean_norm"] / applied  # mean ||hbar||
            if window["omega_rounds"]:
                logs["attack_omega"] = window["omega"] / window["omega_rounds"]
            if getattr(self.aggregator, "last_kept", None) is not None:
                logs["byzantine_values_kept"] = int(window["byzantine_values_kept"])
            # Gaussian numbers drawn since the last log (perturbed forwards and updates), in units of d
            logs["generator_passes_per_round"] = (COUNTER.drawn - self._drawn_at_log) / (
                window["rounds"] * self.table.numel
            )
            self._window = dict.fromkeys(window, 0)
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


__all__ = ["RoundClients", "ZOByzantineTrainer"]

"""MiniLM's own weights trained by the protocol under attack: probe, then fine-tune (issue 18, item 2).

1. Probe: the zeroth-order head of ``real_model.py`` on the frozen encoder's cached features (same data,
   federation, rule and attack; 600 rounds, B = 64, nu = 64).
2. Fine-tune: :class:`~zo_byzantine.features.PooledClassifier` (encoder, mean pooling, the probe's
   standardisation and head), so that training starts from the probe's predictions; ``ZOByzantineTrainer``
   perturbs and updates the encoder's weights (``--trainable``: ``layers`` = the six Transformer layers, the
   embeddings frozen; ``lora``; ``all``) and the head, n = 12, b = 3, Dirichlet alpha = 1, the same rule and
   attack, constant learning rate, until ``--rounds`` or ``--minutes``. Validation accuracy every
   ``--eval_every`` rounds, with the training seconds spent so far.

    python experiments/real_model/encoder.py --task sst2 --attack none --minutes 6 --out sst2_none.json  # on a GPU
    python experiments/real_model/encoder.py --smoke                                                      # CI smoke

``--checkpoint_dir D`` keeps a checkpoint there at every evaluation and when the time is up; started again with the
same arguments, the run resumes from the newest one (the trainer's resume: the same trajectory) and ``--out`` gets
the whole curve (accuracies from the restored history; the earlier legs and their seconds from the ``--out`` they
wrote, refused when it records other settings). On the CPU the rounds' forwards are grouped by length
(``zo_group_by_length``; ``--no-group_by_length``: padded to the round's longest sentence).

References (``real_model.md`` beside this script, centralised, first-order): full fine-tuning 83.4 (SST-2) and 96.8
(TREC); the zeroth-order head on frozen features 78.1 and 88.5 without attack.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time

import torch
from transformers import DataCollatorWithPadding

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # _common.py, shared with the benchmarks
sys.path.insert(0, os.path.join(ROOT, "experiments", "fedes"))  # fedes.last_checkpoint
sys.path.insert(0, HERE)

from _common import Progress  # noqa: E402
from fedes import last_checkpoint  # noqa: E402
from real_model import (  # noqa: E402
    PER_CLASS,
    first_order_head,
    load,
    load_minilm,
    max_length,
    zo_arguments,
    zo_run,
)

from zo_byzantine import ZOByzantineTrainer  # noqa: E402
from zo_byzantine.features import FeatureHead, PooledClassifier  # noqa: E402
from zo_byzantine.metrics import compute_metrics_fn  # noqa: E402

TRAINABLE = ("layers", "lora", "all")
STARTED = time.monotonic()


def select_trainable(model: PooledClassifier, trainable: str, lora_r: int) -> PooledClassifier:
    """Freeze what ``trainable`` leaves out: ``layers`` the embeddings; ``lora`` the whole encoder behind LoRA
    adapters (rank ``lora_r`` on query and value); ``all`` nothing. The head always trains."""
    if trainable not in TRAINABLE:
        raise ValueError(f"--trainable={trainable!r}; accepted: {', '.join(TRAINABLE)}.")
    if trainable == "layers":
        model.encoder.embeddings.requires_grad_(False)
    elif trainable == "lora":
        from peft import LoraConfig, get_peft_model

        model.encoder = get_peft_model(model.encoder, LoraConfig(r=lora_r, lora_alpha=2 * lora_r,
                                                                 target_modules=["query", "value"]))
    return model


def probe_file(args) -> str | None:
    """Where ``--probe_dir`` keeps the probe of this task, rule, attack, seed, probe length and ``--per_class`` (or
    None)."""
    if args.probe_dir is None:
        return None
    name = f"{args.task}_{args.rule}_{args.attack}_s{args.seed}_r{args.probe_rounds}_n{args.per_class}.pt"
    return os.path.join(args.probe_dir, name)


def save_probe(path: str, probe: dict, mean: torch.Tensor, std: torch.Tensor) -> None:
    """The probe's head, its figures and the statistics of the features it was trained on."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save({"head": {k: v.cpu() for k, v in probe["model"].state_dict().items()},
                "features": {"mean": mean.cpu(), "std": std.cpu()},
                "result": {k: v for k, v in probe.items() if k != "model"}}, path)


def load_probe(path: str, dim: int, num_labels: int, mean: torch.Tensor, std: torch.Tensor) -> dict:
    """A probe saved by :func:`save_probe` (tensors and plain values only: ``weights_only``), refused when the
    training features' statistics differ from ``mean`` and ``std`` (other weights, data, or sample): a probe
    reused on other features would not start the fine-tuning at its accuracy."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    had = saved["features"]
    for name, now, then in (("mean", mean.cpu(), had["mean"]), ("std", std.cpu(), had["std"])):
        finite = torch.isfinite(now)
        if now.shape != then.shape or not torch.equal(finite, torch.isfinite(then)) or not torch.allclose(
                now[finite].double(), then[finite].double(), rtol=1e-3, atol=1e-4):
            raise ValueError(f"--probe_dir: {path} was trained on features whose {name} differs from this run's "
                             "(other encoder weights, data or sample); remove it or use another --probe_dir.")
    head = FeatureHead(dim, num_labels)
    head.load_state_dict(saved["head"])
    return {**saved["result"], "model": head, "loaded_from": os.path.basename(path)}


def tokenized(tokenizer, examples: list[dict], length: int) -> list[dict]:
    encoded = tokenizer([e["text_a"] for e in examples], truncation=True, max_length=length)
    return [{**{k: v[i] for k, v in encoded.items()}, "labels": int(e["label"])} for i, e in enumerate(examples)]


SETTINGS = ("task", "rule", "attack", "seed", "trainable", "lr", "mu", "nu", "batch_per_client", "group_by_length",
            "per_class")


def settings(args) -> dict:
    """What a resumed leg must share with the earlier ones (its trajectory depends on them)."""
    values = {**vars(args), "batch_per_client": args.batch}
    return {key: values[key] for key in SETTINGS}


def previous_legs(path: str | None, began: int, now: dict) -> tuple[list, dict]:
    """The legs up to round ``began`` that the result JSON ``path`` records (a leg that ended without writing it is
    one of unknown device and seconds), and the training seconds of its evaluated rounds; refused when its
    settings differ from ``now`` (:func:`settings`)."""
    if not began:
        return [], {}
    if path is None or not os.path.exists(path):
        return [{"device": None, "from": 0, "to": began, "seconds": None}], {}
    with open(path) as f:
        earlier = json.load(f)
    differ = {key: (earlier.get(key), now[key]) for key in SETTINGS if earlier.get(key, now[key]) != now[key]}
    if differ:
        raise ValueError(f"--out: {path} was written by a run of other settings than this one's, which resumes its "
                         f"checkpoint: {differ} (earlier, now); resume with the same arguments.")
    legs = [leg for leg in earlier.get("legs", []) if leg["to"] <= began]
    reached = legs[-1]["to"] if legs else 0
    if reached < began:
        legs.append({"device": None, "from": reached, "to": began, "seconds": None})
    return legs, {point[0]: point[2] for point in earlier["curve"] if point[0] <= reached}


def run(args) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.group_by_length is None:  # B-sized chunks pay on the CPU; on a GPU one wide forward may cost less
        args.group_by_length = device == "cpu"
    resume = None if args.checkpoint_dir is None else last_checkpoint(args.checkpoint_dir)
    began = int(resume.rsplit("-", 1)[1]) if resume else 0
    legs, seconds_at = previous_legs(args.out, began, settings(args))  # refused before any work
    data_dir = os.path.join(args.data, args.task)
    dev_size = 100 if args.smoke else None
    train_rows, dev_rows, (train_f, dev_f), spec, (mean, std) = load(args.task, data_dir, args.per_class, dev_size,
                                                                       args.seed, device)
    frozen = first_order_head(train_f, dev_f, spec, args.seed)  # the frozen-feature ceiling on this run's data
    probe_began = time.perf_counter()
    saved = probe_file(args)
    if args.probe_rounds == 0:  # timing runs: an untrained head
        probe = {"model": FeatureHead(train_f.x.shape[1], spec.num_labels), "best": math.nan, "final": math.nan}
    elif saved is not None and os.path.exists(saved):
        probe = load_probe(saved, train_f.x.shape[1], spec.num_labels, mean, std)
    else:
        with tempfile.TemporaryDirectory() as out:
            probe = zo_run(train_f, dev_f, spec, args.rule, args.attack, args.seed, args.probe_rounds,
                           max(args.probe_rounds // 4, 1), out, keep_model=True)
        if saved is not None:
            save_probe(saved, probe, mean, std)
    probe_seconds = time.perf_counter() - probe_began
    print(f"{args.task} {args.rule}/{args.attack}, {len(train_rows)} training examples: probe best {probe['best']:.3f} "
          f"final {probe['final']:.3f} ({probe_seconds:.0f} s); frozen features, first order: {frozen:.3f}", flush=True)
    if args.probe_only:
        return {"probe": {k: v for k, v in probe.items() if k != "model"}, "probe_seconds": probe_seconds}

    tokenizer, encoder = load_minilm(device)
    model = select_trainable(PooledClassifier(encoder, probe["model"], mean, std), args.trainable, args.lora_r)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    progress = Progress(None if args.minutes is None else 60 * args.minutes,
                        None if args.wall_minutes is None else STARTED + 60 * args.wall_minutes)
    with contextlib.ExitStack() as stack:
        out = args.checkpoint_dir or stack.enter_context(tempfile.TemporaryDirectory())
        saving = {} if args.checkpoint_dir is None else {"save_strategy": "steps", "save_steps": args.eval_every,
                                                         "save_total_limit": 1}
        torch.manual_seed(args.seed)
        zo = zo_arguments(out, args.rule, args.attack, args.seed, args.rounds, args.eval_every,
                          per_device_train_batch_size=args.batch, num_perturbations=args.nu, zo_eps=args.mu,
                          learning_rate=args.lr, lr_scheduler_type="constant", per_device_eval_batch_size=256,
                          use_cpu=device == "cpu", zo_group_by_length=args.group_by_length, **saving)
        trainer = ZOByzantineTrainer(
            model=model, args=zo, train_dataset=tokenized(tokenizer, train_rows, max_length(spec)),
            eval_dataset=tokenized(tokenizer, dev_rows, max_length(spec)),
            data_collator=DataCollatorWithPadding(tokenizer),
            compute_metrics=compute_metrics_fn(["accuracy"]), callbacks=[progress],
        )
        start = trainer.evaluate()["eval_accuracy"]  # the probe's start (a checkpoint is loaded by train())
        trainer.train(resume_from_checkpoint=resume)
        history = trainer.state.log_history  # restored on resume: the whole run's
    rounds = trainer.state.global_step
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    known = [leg["seconds"] for leg in legs]
    earlier = None if None in known else sum(known)  # the training seconds before this leg
    if progress.rounds:  # the rounds this leg trained, as counted by its callback (not read off the checkpoint)
        legs.append({"device": name, "from": rounds - progress.rounds, "to": rounds,
                     "seconds": round(progress.spent, 2)})
        seconds_at.update({step: None if earlier is None else round(earlier + spent, 2)
                           for step, _, spent in progress.curve})
    curve = [(0, start, 0.0)] + [(e["step"], e["eval_accuracy"], seconds_at.get(e["step"]))
                                 for e in history if "eval_accuracy" in e and e["step"] > 0]
    accuracies = [a for _, a, _ in curve]
    losses = [(e["step"], e["loss"]) for e in history if "loss" in e]
    result = {
        "task": args.task, "rule": args.rule, "attack": args.attack, "seed": args.seed, "trainable": args.trainable,
        "trainable_parameters": trainable, "lr": args.lr, "mu": args.mu, "nu": args.nu, "batch_per_client": args.batch,
        "group_by_length": args.group_by_length, "per_class": args.per_class, "train_examples": len(train_rows),
        "frozen_first_order_head": frozen, "device": name,
        "probe": {k: v for k, v in probe.items() if k != "model"}, "probe_seconds": probe_seconds,
        "start": start, "best": max([start, *accuracies]), "final": accuracies[-1] if accuracies else start,
        "rounds": rounds, "seconds": None if any(leg["seconds"] is None for leg in legs) else round(
            sum(leg["seconds"] for leg in legs), 2),
        "ms_per_round": 1000 * progress.spent / max(progress.rounds, 1), "legs": legs, "curve": curve,
        "loss": losses,
    }
    print(f"{args.task} {args.rule}/{args.attack} {args.trainable} lr {args.lr}: start {start:.3f} best "
          f"{result['best']:.3f} final {result['final']:.3f} after {rounds} rounds "
          f"({result['ms_per_round']:.1f} ms/round on {result['device']}, from round {began})", flush=True)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="sst2", choices=["sst2", "trec"])
    parser.add_argument("--rule", default="cwtm")
    parser.add_argument("--attack", default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainable", default="layers", choices=TRAINABLE)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--mu", type=float, default=1e-3)
    parser.add_argument("--nu", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16, help="examples per client per round")
    parser.add_argument("--per_class", type=int, default=None,
                        help="training examples per class (default: real_model.PER_CLASS, SST-2 1,000, TREC all)")
    parser.add_argument("--probe_rounds", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=100_000)
    parser.add_argument("--minutes", type=float, default=None, help="stop after this much training time")
    parser.add_argument("--wall_minutes", type=float, default=None,
                        help="stop training this long after the script started (loading and probe included)")
    parser.add_argument("--eval_every", type=int, default=250)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--checkpoint_dir", default=None,
                        help="keep checkpoints here; a run started again resumes from the newest one")
    parser.add_argument("--group_by_length", action=argparse.BooleanOptionalAction, default=None,
                        help="forwards of examples of similar length, each cut to its longest (zo_group_by_length); "
                             "default: on the CPU")
    parser.add_argument("--probe_dir", default=None,
                        help="keep probes here: a saved probe of the same task, rule, attack, seed is reused")
    parser.add_argument("--probe_only", action="store_true", help="stop after the probe (to prepare --probe_dir)")
    parser.add_argument("--smoke", action="store_true", help="16 examples per class, 100 validation, few rounds")
    args = parser.parse_args(argv)
    if args.probe_only and args.probe_dir is None:
        parser.error("--probe_only keeps the probe in --probe_dir: give --probe_dir.")
    if args.per_class is not None and args.per_class < 1:
        parser.error(f"--per_class={args.per_class}; accepted: a positive number of examples per class.")
    if args.smoke:
        args.per_class, args.probe_rounds, args.rounds, args.eval_every, args.batch = 16, 8, min(args.rounds, 4), 2, 4
    elif args.per_class is None:
        args.per_class = PER_CLASS[args.task]
    logging.disable(logging.WARNING)
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()

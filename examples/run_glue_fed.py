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
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
)

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer
from zo_byzantine.metrics import compute_metrics_fn
from zo_byzantine.prompts import PromptModel, encode_example, label_token_ids
from zo_byzantine.tasks import load_hub_split, load_local_split, load_task, sample, sample_per_class

logger = logging.getLogger("run_glue_fed")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="FacebookAI/roberta-large", metadata={"help": "Hub id or local folder."})
    prompt_kind: str = field(default="auto", metadata={"help": "masked_lm, causal_lm or auto (from the config)."})
    save_final_model: bool = field(
        default=False,
        metadata={"help": "Also save the final weights (the ledger alone rebuilds them from the start weights)."},
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


def load_model(model_args: ModelArguments):
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    kind = model_args.prompt_kind
    if kind == "auto":
        kind = "masked_lm" if type(config) in MODEL_FOR_MASKED_LM_MAPPING and not config.is_decoder else "causal_lm"
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    auto = AutoModelForMaskedLM if kind == "masked_lm" else AutoModelForCausalLM
    lm = auto.from_pretrained(model_args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return lm, tokenizer, kind


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
        return datasets.Dataset.from_list(
            [encode_example(e, spec, tokenizer, kind, data_args.max_length) for e in examples]
        )

    return encode(train), encode(evaluation)


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, GlueFedArguments))
    model_args, data_args, args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    spec = load_task(data_args.task)  # unknown task: clear error before anything else
    check_offline(model_args, data_args)

    lm, tokenizer, kind = load_model(model_args)
    model = PromptModel(lm, label_token_ids(spec, tokenizer, kind), kind, tokenizer.mask_token_id)
    train_set, eval_set = build_datasets(spec, data_args, tokenizer, kind, args.seed)
    logger.info(
        "task %s (%s prompts): %d training, %d evaluation examples", spec.name, kind, len(train_set), len(eval_set)
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

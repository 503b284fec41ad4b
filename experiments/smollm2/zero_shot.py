"""Zero-shot accuracy of a causal LM shipped on PyPI (SmolLM2-135M by default) on the tasks' evaluation splits, for
each candidate causal template and its label words (issue 49: small LMs are template-sensitive, and zero-shot is the
bar a fine-tune must beat). Every example is scored by the library's ``PromptModel``: the next-token logits after
the prompt, restricted to the label words, at the last attended position.

    python experiments/smollm2/zero_shot.py                       # every task, every candidate -> zero_shot.md
    python experiments/smollm2/zero_shot.py --tasks sst2 --limit 200
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
from tqdm.auto import tqdm

from zo_byzantine.models import SHIPPED, load
from zo_byzantine.prompts import PromptModel, encode_example, label_token_ids
from zo_byzantine.tasks import load_local_split, load_task

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "..", "shared", "data")

# per task: candidate name -> (causal template, causal label words by label), beside "spec", tasks/<task>.json's own;
# "(before #49)" is the template the task files had before this comparison chose the best one
CANDIDATES = {
    "sst2": {
        "it was (before #49)": ("{text_a} It was", {"negative": " terrible", "positive": " great"}),
        "review/great": ("Review: {text_a}\nThe review is", {"negative": " bad", "positive": " good"}),
    },
    "rte": {
        "does this mean (before #49)": ("{text_a}\nDoes this mean that \"{text_b}\" is true? Yes or No?\n",
                                        {"entailment": "Yes", "not_entailment": "No"}),
        "premise/hypothesis": ("Premise: {text_a}\nHypothesis: {text_b}\nDoes the premise entail the hypothesis? "
                               "Answer:", {"entailment": " yes", "not_entailment": " no"}),
    },
    "trec": {
        "answer is a (before #49)": ("{text_a} The answer to this question is a",
                                     {"DESC": " Description", "ENTY": " Entity", "ABBR": " Expression",
                                      "HUM": " Human", "LOC": " Location", "NUM": " Number"}),
    },
    "snli": {
        "premise/hypothesis": ("Premise: {text_a}\nHypothesis: {text_b}\nDoes the premise entail the hypothesis? "
                               "Answer:", {"entailment": " yes", "neutral": " maybe", "contradiction": " no"}),
    },
    "mnli": {
        "premise/hypothesis": ("Premise: {text_a}\nHypothesis: {text_b}\nDoes the premise entail the hypothesis? "
                               "Answer:", {"entailment": " yes", "neutral": " maybe", "contradiction": " no"}),
    },
}


def accuracy(model, tokenizer, spec, examples, batch: int) -> float:
    """Share of ``examples`` whose highest label-word logit is their label."""
    ids = label_token_ids(spec, tokenizer, "causal_lm")
    scorer = PromptModel(model, ids, "causal_lm").eval()
    encoded = [encode_example(e, spec, tokenizer, "causal_lm") for e in examples]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    correct = 0
    for start in tqdm(range(0, len(encoded), batch), desc=spec.name, unit="batch", leave=False):
        rows = encoded[start : start + batch]
        width = max(len(r["input_ids"]) for r in rows)
        input_ids = torch.tensor([r["input_ids"] + [pad] * (width - len(r["input_ids"])) for r in rows])
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
        with torch.no_grad():
            logits = scorer(input_ids=input_ids, attention_mask=mask).logits
        correct += int((logits.argmax(1) == torch.tensor([r["labels"] for r in rows])).sum())
    return correct / len(encoded)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(SHIPPED))
    parser.add_argument("--tasks", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--data_dir", default=DATA, help="the folder holding one folder per task")
    parser.add_argument("--limit", type=int, default=1000, help="evaluation examples per task (first ones)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=os.path.join(HERE, "zero_shot.md"))
    args = parser.parse_args(argv)
    if args.limit < 1 or args.batch < 1:
        parser.error(f"--limit={args.limit} and --batch={args.batch} must be >= 1")
    model, tokenizer = load(args.model)
    lines = [f"# Zero-shot accuracy, {args.model}, float32 (`python experiments/smollm2/zero_shot.py "
             f"--tasks {' '.join(args.tasks)} --limit {args.limit}`)", "",
             "| task | candidate | template | label words | examples | accuracy |", "|---|---|---|---|---|---|"]
    for name in args.tasks:
        spec = load_task(name)
        examples = load_local_split(spec, os.path.join(args.data_dir, name), "eval")
        examples = [examples[i] for i in range(min(args.limit, len(examples)))]
        own = {"spec": (spec.template("causal_lm"), spec.words("causal_lm"))}
        for candidate, (template, words) in {**own, **CANDIDATES[name]}.items():
            variant = dataclasses.replace(spec, templates={**spec.templates, "causal_lm": template},
                                          causal_lm_words=dict(words))
            start = time.perf_counter()
            value = accuracy(model, tokenizer, variant, examples, args.batch)
            shown = template.replace("\n", "\\n")
            lines.append(f"| {name} | {candidate} | `{shown}` | {', '.join(repr(w) for w in words.values())} | "
                         f"{len(examples)} | {100 * value:.1f} |")
            print(lines[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

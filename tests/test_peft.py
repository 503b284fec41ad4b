"""PEFT adapters: only the adapter's (and saved modules') parameters are perturbed and updated."""

import torch
from helpers import TextDataset, collate, make_trainer, tiny_bert, wordpiece_tokenizer
from peft import LoraConfig, get_peft_model

from zo_byzantine.perturbation import ParameterTable


def test_lora_trains_only_the_adapter_and_saves_it_the_peft_way(tmp_path):
    tokenizer = wordpiece_tokenizer()
    model = get_peft_model(tiny_bert(vocab_size=tokenizer.vocab_size),
                           LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["query", "value"]))
    table = ParameterTable(model)
    assert table.names and all("lora_" in n or "classifier" in n for n in table.names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(model, TextDataset(tokenizer, 48), tmp_path, collate(tokenizer), num_clients=3,
                           max_steps=3, learning_rate=1e-1, num_perturbations=2)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(table.names) | {n for n in before if "lora_" in n or "classifier" in n}
    assert any("lora_B" in n for n in changed)  # lora_B starts at zero: it moved
    assert not trainer.table.unreached()
    trainer.save_model(str(tmp_path / "adapter"))
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "zo_ledger.json"} <= files


def test_unreached_parameters_are_named(tmp_path, caplog):
    tokenizer = wordpiece_tokenizer()
    model = tiny_bert(vocab_size=tokenizer.vocab_size)  # the pooler feeds the classifier; nothing unreached
    model.extra = torch.nn.Linear(2, 2)  # never called in forward
    trainer = make_trainer(model, TextDataset(tokenizer, 24), tmp_path, collate(tokenizer), max_steps=1)
    trainer.train()
    assert trainer.table.unreached() == ["extra.weight", "extra.bias"]
    assert "never reached" in caplog.text and "extra.weight" in caplog.text

"""Worker for test_distributed.py: a few rounds on a tiny model; each process saves what it holds.

python tests/dist_worker.py OUT [protocol flags as key=value]          # one process
python -m torch.distributed.run --nproc_per_node 2 tests/dist_worker.py OUT ...
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from helpers import LogisticRegression, VectorDataset, make_trainer  # noqa: E402


def main():
    out = sys.argv[1]
    extra = dict(item.split("=", 1) for item in sys.argv[2:])
    extra = {k: json.loads(v) for k, v in extra.items()}
    torch.manual_seed(0)
    model = LogisticRegression()
    settings = dict(
        num_clients=6,
        num_byzantine=1,
        per_device_train_batch_size=8,
        max_steps=4,
        num_perturbations=3,
        aggregator="median",
        attack="alie",
        attack_kwargs={"omega": "auto"},
        partition="dirichlet",
        learning_rate=0.2,
        logging_steps=2,
        save_strategy="steps",
        save_steps=4,
        use_cpu=True,
    )
    settings.update(extra)
    trainer = make_trainer(model, VectorDataset(256), out, **settings)
    trainer.train()
    rank = trainer.args.process_index
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(
        {
            "state": state,
            "log": trainer.state.log_history,
            "world": trainer.args.world_size,
            "ledger": trainer.ledger.rounds,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    if torch.distributed.is_initialized():
        # both ranks have saved; leave without tearing gloo down: destroy_process_group (and gloo's threads
        # at interpreter exit) hung here about 1 run in 25 (pytorch/pytorch#75097), os._exit skips that
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

"""A DeepSpeed training run over ``training_data`` that saves, and may be SIGKILLed; run by test_resume.py.

usage: python resume_worker.py ROOT SAVE_AT KILL_AT NAME   (a plain process, or a rank under torchrun)

Trains TOTAL steps of the model below in passes, on the loader ``hierps.deepspeed.initialize``
returns (shuffled by DeepSpeed's sampler, with its worker processes), with the user's loop
``while step < TOTAL: for batch in loader``. It saves at SAVE_AT (a comma list of steps) and kills
itself with SIGKILL after step KILL_AT (0: never). When ROOT/ckpt has a checkpoint, the model is
built from another seed and ``engine.load_checkpoint`` brings it back. Writes ROOT/NAME-RANK.json:
each step's loss and ids, and at the end the rows of every id and the dense parameters.
With HIERPS_NODE_LOCAL=1, DeepSpeed saves with ``"checkpoint": {"use_node_local_storage": true}``
(ROOT on each host's own disk: test_hosts.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import deepspeed.ops
import torch
from torch import nn

import hierps

VOCAB, DIM, BAG, BATCH = 200, 4, 3, 8
EPOCH = 10  # batches per epoch and rank
TOTAL = 24


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
        self.head = nn.Linear(DIM + 1, 1)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.emb(ids), dense], dim=1)).squeeze(1)


def dataset(world: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = BATCH * EPOCH * world
    u = torch.rand((n, BAG), generator=g, dtype=torch.float64)
    ids = ((1 - u) ** (-1 / 0.7)).long().sub(1) % VOCAB
    return torch.utils.data.TensorDataset(
        ids, torch.randn(n, 1, generator=g), torch.randint(0, 2, (n,), generator=g).float()
    )


def main(root: str, save_at: str, kill_at: str, name: str) -> None:
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo serves these small collectives
    world = int(os.environ.get("WORLD_SIZE", "1"))
    resume = (Path(root) / "ckpt" / "latest").exists()
    torch.manual_seed(7 if resume else 1)
    model = Model()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "hierarchical_ps": {
            "path": f"{root}/store",
            "modules": ["emb"],
            "optimizer": {"type": "adagrad", "params": {"lr": 0.1}},
            "pass_batches": 4,
            "memory_budget": "4KiB",
            "device_budget": "64KiB",
        },
    }
    if os.environ.get("HIERPS_NODE_LOCAL") == "1":
        config["checkpoint"] = {"use_node_local_storage": True}
    engine, _, loader, _ = hierps.deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.head.parameters(), lr=0.01),
        config=config,
        training_data=dataset(world),
    )
    rank = engine.global_rank
    step = 0
    if resume:
        engine.load_checkpoint(f"{root}/ckpt")
        step = int(engine.global_steps)
    saves = {int(s) for s in save_at.split(",") if s}
    steps: dict[int, list] = {}
    out = Path(root) / f"{name}-{rank}.json"
    while step < TOTAL:
        for ids, dense, labels in loader:
            loss = nn.functional.binary_cross_entropy_with_logits(engine(ids, dense), labels)
            engine.backward(loss)
            engine.step()
            step += 1
            steps[step] = [loss.item(), ids.reshape(-1).tolist()]
            if step in saves:
                engine.save_checkpoint(f"{root}/ckpt", tag=f"s{step}")
            if step == int(kill_at):
                out.write_text(json.dumps({"steps": steps}))
                os.kill(os.getpid(), signal.SIGKILL)
            if step == TOTAL:
                break
    rows = engine.module.emb.lookup(torch.arange(VOCAB))
    dense_params = torch.cat([p.detach().reshape(-1) for p in engine.module.head.parameters()])
    out.write_text(json.dumps({"steps": steps, "rows": rows.tolist(), "dense": dense_params.tolist()}))
    engine.destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Trains a DeepSpeed engine and saves two tags; run as a subprocess by test_deepspeed.py, which
kills it inside the second save with ``HIERPS_FAULT``.

usage: python ds_save_worker.py STORE CKPT OUT KEEP TAG1 TAG2
Writes OUT/first.pt and OUT/second.pt: the rows of every id and the dense parameters as each
save began.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch
from oracle import zipf_batches
from test_deepspeed import BAG, BATCH, VOCAB, ds_config, skip_shm_build, state, train_engine, twins

from hierps.integrations import deepspeed as hds
from hierps.integrations.rendezvous import free_port


def main(store: str, ckpt: str, out: str, keep: str, tag1: str, tag2: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    os.environ["LOCAL_RANK"] = "0"
    skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    batches = zipf_batches(8, batch=BATCH, bag=BAG, vocab=VOCAB, seed=5)
    _, model = twins()
    engine, _, _, _ = hds.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        config=ds_config(store, gas=1, stage=1, opt="adam", keep_checkpoints=int(keep)),
    )
    for name, part, tag in (("first", batches[:4], tag1), ("second", batches[4:], tag2)):
        train_engine(engine, part, pass_batches=2)
        torch.save(state(engine), Path(out) / f"{name}.pt")
        engine.save_checkpoint(ckpt, tag=tag)
    print("saved both", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

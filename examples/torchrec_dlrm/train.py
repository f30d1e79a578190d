"""TorchRec's own DLRM (``torchrec.models.dlrm.DLRM``) with its tables in a hierps store.

The model is TorchRec's, unchanged: an ``EmbeddingBagCollection`` fed ``KeyedJaggedTensor``s.
Three lines differ from a plain TorchRec loop (marked ``# hierps``): open a store, swap the
collection's tables into it, and take the sparse step after the dense one. Data: synthetic clicks
whose odds follow a hidden weight per id, so the loss falls as the rows learn.

    python examples/torchrec_dlrm/train.py --path /tmp/hierps-torchrec --steps 200
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

import hierps
from hierps.integrations.torchrec import swap_torchrec

FEATURES = ["user", "item", "ad"]
DIM, DENSE = 16, 8


def build_model(rows: int) -> DLRM:
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
        for f in FEATURES
    ]
    return DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[32, DIM],
        over_arch_layer_sizes=[32, 1],
    )


def batches(
    steps: int, batch_size: int, rows: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """(dense (B, 8), sparse KJT of 1-3 ids per feature (skewed), labels (B,)) for ``steps`` batches."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(FEATURES), rows, generator=g)
    for _ in range(steps):
        lengths = torch.randint(1, 4, (len(FEATURES), batch_size), generator=g)
        ids = (torch.rand(int(lengths.sum()), generator=g) ** 3 * rows).long()  # a few hot ids
        which = torch.repeat_interleave(torch.arange(len(FEATURES)), lengths.sum(1))
        logit = torch.zeros(batch_size).index_add_(
            0,
            torch.repeat_interleave(torch.arange(batch_size).repeat(len(FEATURES)), lengths.flatten()),
            hidden[which, ids],
        )
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=ids, lengths=lengths.flatten())
        yield torch.randn(batch_size, DENSE, generator=g), kjt, labels


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="store directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rows", type=int, default=50_000, help="rows per table")
    args = ap.parse_args(argv)
    path = args.path or tempfile.mkdtemp(prefix="hierps-torchrec-")

    torch.manual_seed(0)
    model = build_model(args.rows)
    store = hierps.Store(
        path, memory_budget="64MiB", optimizer={"type": "adagrad", "params": {"lr": 0.05}}
    )  # hierps
    swap_torchrec(model, store)  # hierps: the collection's tables now live in the store
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # the dense layers: no table is a parameter

    losses = []
    for step, (dense, sparse, labels) in enumerate(batches(args.steps, args.batch_size, args.rows)):
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(1), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        store.step()  # hierps: one sparse step for every row the batch touched
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {sum(losses[-50:]) / len(losses[-50:]):.4f}")
    store.checkpoint()
    print(f"checkpoint in {path}")
    store.close()
    return losses


if __name__ == "__main__":
    main()

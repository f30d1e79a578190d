"""The reference for correctness: the same model trained with plain PyTorch sparse embeddings."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import hierps

TORCH_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.5}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.3}),
    "adam": (torch.optim.SparseAdam, {"lr": 0.05}),
}


class TinyModel(nn.Module):
    """One embedding module (bag or plain) and a dense head: enough to exercise every path."""

    def __init__(self, emb: nn.Module, dim: int) -> None:
        super().__init__()
        self.emb = emb
        self.head = nn.Sequential(nn.Linear(dim, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None, psw: torch.Tensor | None = None):
        if isinstance(self.emb, (nn.EmbeddingBag, hierps.EmbeddingBag)):
            x = self.emb(ids, offsets, per_sample_weights=psw)
        else:
            x = self.emb(ids).mean(dim=1)
        return self.head(x).squeeze(-1)


@dataclass
class Batch:
    ids: torch.Tensor
    offsets: torch.Tensor | None
    labels: torch.Tensor
    psw: torch.Tensor | None = None


def zipf_batches(
    n_batches: int, batch: int, bag: int, vocab: int, seed: int = 0, bags: bool = True, weights: bool = False
) -> list[Batch]:
    """Power-law ids (many repeats per mini-batch) in [0, vocab)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        ids = (rng.zipf(1.3, size=(batch, bag)) - 1) % vocab
        labels = torch.from_numpy(rng.integers(0, 2, size=batch).astype(np.float32))
        t = torch.from_numpy(ids.astype(np.int64))
        if bags:
            offsets = torch.arange(0, batch * bag, bag)
            psw = torch.from_numpy(rng.random(batch * bag).astype(np.float32)) if weights else None
            out.append(Batch(t.reshape(-1), offsets, labels, psw))
        else:
            out.append(Batch(t, None, labels))
    return out


def train(
    model: nn.Module,
    sparse_opt,
    dense_opt,
    batches: list[Batch],
    store: hierps.Store | None = None,
    accumulate: int = 1,
    pass_batches: int | None = None,
) -> list[float]:
    """Train and return the losses; ``store.step()`` stands where the sparse optimizer's step is."""
    losses = []
    loss_fn = nn.BCEWithLogitsLoss()
    for i, b in enumerate(batches):
        if store is not None and pass_batches and i % pass_batches == 0:
            group = batches[i : i + pass_batches]
            store.begin_pass([{model.emb.table: g.ids} for g in group])
        loss = loss_fn(model(b.ids, b.offsets, b.psw), b.labels) / accumulate
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            dense_opt.step()
            dense_opt.zero_grad()
            if store is not None:
                store.step()
            else:
                sparse_opt.step()
                sparse_opt.zero_grad()
        if store is not None and pass_batches and (i + 1) % pass_batches == 0:
            store.end_pass()
    return losses


def twin_models(
    kind: str,
    vocab: int,
    dim: int,
    store: hierps.Store,
    opt: str,
    mode: str = "sum",
    padding_idx: int | None = None,
):
    """(reference model, hierps model) with equal initial weights."""
    torch.manual_seed(1)
    if kind == "bag":
        # torch has no sparse gradient for max bags; its dense gradient steps the same rows
        # under sgd / adagrad (rows without gradient do not move).
        emb = nn.EmbeddingBag(vocab, dim, mode=mode, sparse=mode != "max", padding_idx=padding_idx)
    else:
        emb = nn.Embedding(vocab, dim, sparse=True, padding_idx=padding_idx)
    ref = TinyModel(emb, dim)
    twin = copy.deepcopy(ref)
    cls = hierps.EmbeddingBag if kind == "bag" else hierps.Embedding
    params = TORCH_OPTIMIZERS[opt][1]
    twin.emb = cls.from_module(ref.emb, store=store, name="t", optimizer={"type": opt, "params": params})
    return ref, twin


def make_optimizers(ref: nn.Module, twin: nn.Module, opt: str):
    cls, params = TORCH_OPTIMIZERS[opt]
    sparse_ref = cls(ref.emb.parameters(), **params)
    dense_ref = torch.optim.Adam(ref.head.parameters(), lr=0.01)
    dense_twin = torch.optim.Adam(twin.head.parameters(), lr=0.01)
    return sparse_ref, dense_ref, dense_twin

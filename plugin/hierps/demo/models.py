"""Click models built only from standard torch modules: a small DLRM, a wide (logistic) model, and
the reference DLRM of dlrm's Criteo Kaggle setup (:class:`ReferenceDLRM`: bags of ids, one offsets
tensor per table).

Every categorical feature owns one plain ``nn.EmbeddingBag`` in ``model.tables`` (state-dict
names ``tables.0.weight`` ... ``tables.25.weight``), called as ``table(ids, offsets)`` with one
id per bag. Keeping the tables plain and uniformly called is what lets them be swapped for
another embedding store without touching the rest of the model.

Plain ``nn.EmbeddingBag`` only accepts ids in ``[0, n)``; raw 64-bit feature ids are folded
into that range with :func:`remap_ids` first.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import cast, overload

import numpy as np
import torch
from torch import nn

from hierps.rows import splitmix64

__all__ = ["DLRM", "MODELS", "ClickModel", "ReferenceDLRM", "Wide", "make_model", "remap_ids"]


@overload
def remap_ids(sparse: torch.Tensor, vocab_sizes: Sequence[int] | int) -> torch.Tensor: ...
@overload
def remap_ids(sparse: np.ndarray, vocab_sizes: Sequence[int] | int) -> np.ndarray: ...
def remap_ids(
    sparse: torch.Tensor | np.ndarray, vocab_sizes: Sequence[int] | int
) -> torch.Tensor | np.ndarray:
    """Fold raw int64 ids ``(B, F)`` into ``[0, vocab_sizes[f])`` by ``splitmix64(id) % n_f``.

    Returns int64 ``(B, F)`` of the input's kind (tensor on the same device, or ndarray).
    Collision-prone by design: distinct raw ids can share a row (about 37% of ids do when the
    bucket count equals the number of distinct ids), which is acceptable only for a plain-torch
    baseline. The hash first spreads ids so structured raw ids still fill buckets evenly.
    """
    ids = sparse.detach().cpu().numpy() if isinstance(sparse, torch.Tensor) else np.asarray(sparse)
    if ids.ndim != 2:
        raise ValueError(f"expected (B, F) ids, got shape {ids.shape}")
    n_features = ids.shape[1]
    sizes = np.full(n_features, vocab_sizes) if isinstance(vocab_sizes, int) else np.asarray(vocab_sizes)
    if sizes.shape != (n_features,) or (sizes < 1).any():
        raise ValueError(f"need {n_features} positive vocab sizes")
    hashed = splitmix64(ids.astype(np.int64).view(np.uint64)) % sizes.astype(np.uint64)
    out = hashed.astype(np.int64)
    return torch.from_numpy(out).to(sparse.device) if isinstance(sparse, torch.Tensor) else out


class ClickModel(nn.Module):
    """What :class:`DLRM` and :class:`Wide` share: ``tables`` (one module per categorical feature,
    called as ``table(ids, offsets)``), their sizes, and the sparse / dense parameter groups."""

    tables: nn.ModuleList
    vocab_sizes: tuple[int, ...]
    embedding_dim: int
    n_dense: int

    def sparse_parameters(self) -> Iterator[nn.Parameter]:
        """Embedding-table weights: they receive sparse gradients (use Adagrad / SparseAdam)."""
        return self.tables.parameters()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Every other weight: dense gradients (use Adam or SGD)."""
        sparse = {id(p) for p in self.sparse_parameters()}
        return (p for p in self.parameters() if id(p) not in sparse)


def _add_tables(
    model: ClickModel, vocab_sizes: Sequence[int] | int, dim: int, mode: str, n_dense: int, n_sparse: int
) -> list[int]:
    """Give ``model`` its ``tables`` (one sparse ``nn.EmbeddingBag`` per feature) and sizes."""
    sizes = [vocab_sizes] * n_sparse if isinstance(vocab_sizes, int) else [int(n) for n in vocab_sizes]
    model.vocab_sizes = tuple(sizes)
    model.embedding_dim = dim
    model.n_dense = n_dense
    model.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode=mode, sparse=True) for n in sizes)
    return sizes


def _mlp(n_in: int, widths: Sequence[int], relu_last: bool) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them (and after the last if asked)."""
    layers: list[nn.Module] = []
    for i, n_out in enumerate(widths):
        layers.append(nn.Linear(n_in, n_out))
        if relu_last or i < len(widths) - 1:
            layers.append(nn.ReLU())
        n_in = n_out
    return nn.Sequential(*layers)


class DLRM(ClickModel):
    """DLRM: bottom MLP on dense features, pairwise dot products, top MLP to one logit.

    Args:
        vocab_sizes: rows per embedding table, one per categorical feature, or one int used
            for all ``n_sparse`` features.
        embedding_dim: width ``d`` of every embedding; must equal ``bottom[-1]`` because the
            bottom output takes part in the dot-product interaction.
        bottom: hidden widths of the bottom MLP (``n_dense -> ... -> d``).
        top: hidden widths of the top MLP; a final linear layer to one logit is appended.
        mode: ``nn.EmbeddingBag`` reduction; bags hold one id each, so all modes agree.
        n_dense: number of dense features.
        n_sparse: number of categorical features when ``vocab_sizes`` is an int.
    """

    _pair_i: torch.Tensor  # buffers: row / column of each interacting pair
    _pair_j: torch.Tensor

    def __init__(
        self,
        vocab_sizes: Sequence[int] | int,
        embedding_dim: int = 16,
        bottom: Sequence[int] = (64, 16),
        top: Sequence[int] = (64, 32),
        mode: str = "sum",
        n_dense: int = 13,
        n_sparse: int = 26,
    ) -> None:
        super().__init__()
        if not bottom or bottom[-1] != embedding_dim:
            raise ValueError(f"bottom MLP must end at embedding_dim={embedding_dim}, got {tuple(bottom)}")
        sizes = _add_tables(self, vocab_sizes, embedding_dim, mode, n_dense, n_sparse)
        self.bottom = _mlp(n_dense, bottom, relu_last=True)
        # Interaction over the bottom output plus one vector per table: the strict upper
        # triangle of their Gram matrix, i.e. each unordered pair once and no self-products.
        n_vectors = len(sizes) + 1
        tri = torch.triu_indices(n_vectors, n_vectors, offset=1)
        self.register_buffer("_pair_i", tri[0], persistent=False)
        self.register_buffer("_pair_j", tri[1], persistent=False)
        self.top = _mlp(embedding_dim + tri.shape[1], (*top, 1), relu_last=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """DLRM reference init; deterministic under ``torch.manual_seed``.

        Embeddings ~ U(-1/sqrt(n), 1/sqrt(n)) keeps sums of dot products small for big tables;
        linear weights ~ N(0, 2 / (fan_in + fan_out)) and biases ~ N(0, 1 / fan_out).
        """
        for i, table in enumerate(self.tables):
            if not isinstance(table, nn.EmbeddingBag):
                raise TypeError(
                    f"reset_parameters: tables.{i} is a {type(table).__name__}, not nn.EmbeddingBag"
                )
            bound = 1.0 / math.sqrt(table.num_embeddings)
            table.weight.uniform_(-bound, bound)
        for layer in [*self.bottom, *self.top]:
            if isinstance(layer, nn.Linear):
                fan_out, fan_in = layer.weight.shape
                layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
                layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out))

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """All MLP weights and biases, bottom then top: dense gradients (use Adam or SGD)."""
        yield from self.bottom.parameters()
        yield from self.top.parameters()

    def interact(self, bottom_out: torch.Tensor, embeddings: Sequence[torch.Tensor]) -> torch.Tensor:
        """``(B, d)`` bottom output and F ``(B, d)`` embeddings -> ``(B, d + (F+1)F/2)`` features."""
        vectors = torch.stack([bottom_out, *embeddings], dim=1)  # (B, F + 1, d)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, F + 1, F + 1)
        return torch.cat([bottom_out, gram[:, self._pair_i, self._pair_j]], dim=1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """``dense (B, n_dense) float32``, ``sparse (B, F) int64`` ids in range -> ``(B,)`` logits."""
        if sparse.shape[1] != len(self.tables):
            raise ValueError(f"expected {len(self.tables)} id columns, got {sparse.shape[1]}")
        # One id per bag, so bag b starts at position b; built once and shared by all tables.
        offsets = torch.arange(sparse.shape[0], device=sparse.device)
        embeddings = [table(sparse[:, i], offsets) for i, table in enumerate(self.tables)]
        return self.top(self.interact(self.bottom(dense), embeddings)).squeeze(1)


class Wide(ClickModel):
    """A wide click model: one logistic regression over the dense features and the 26 embeddings.

    Almost all of its work is the embedding lookups and updates, as in the sparse "wide" part of
    ads models; it shows the cost of an embedding store where the DLRM's MLPs would hide it.
    Same interface as :class:`DLRM` (``tables``, ``forward(dense, sparse)``, parameter groups).
    """

    def __init__(
        self,
        vocab_sizes: Sequence[int] | int,
        embedding_dim: int = 16,
        mode: str = "sum",
        n_dense: int = 13,
        n_sparse: int = 26,
    ) -> None:
        super().__init__()
        sizes = _add_tables(self, vocab_sizes, embedding_dim, mode, n_dense, n_sparse)
        self.linear = nn.Linear(n_dense + len(sizes) * embedding_dim, 1)
        with torch.no_grad():
            for table in self.tables:
                table = cast(nn.EmbeddingBag, table)  # just built by _add_tables
                bound = 1.0 / math.sqrt(table.num_embeddings)
                table.weight.uniform_(-bound, bound)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """``dense (B, n_dense) float32``, ``sparse (B, F) int64`` ids in range -> ``(B,)`` logits."""
        if sparse.shape[1] != len(self.tables):
            raise ValueError(f"expected {len(self.tables)} id columns, got {sparse.shape[1]}")
        offsets = torch.arange(sparse.shape[0], device=sparse.device)
        embeddings = [table(sparse[:, i], offsets) for i, table in enumerate(self.tables)]
        return self.linear(torch.cat([dense, *embeddings], dim=1)).squeeze(1)


MODELS: dict[str, type[ClickModel]] = {"dlrm": DLRM, "wide": Wide}


def make_model(kind: str, vocab_sizes: Sequence[int] | int, embedding_dim: int, **kwargs: int) -> ClickModel:
    """A model of ``MODELS`` by name (``"dlrm"`` or ``"wide"``) with plain ``nn.EmbeddingBag`` tables."""
    if kind not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}. Got {kind!r} instead.")
    return MODELS[kind](vocab_sizes, embedding_dim=embedding_dim, **kwargs)


class ReferenceDLRM(nn.Module):
    """The reference DLRM of the Criteo Kaggle setup: multi-hot bags, each table with its own offsets.

    Bottom MLP ``n_dense -> 512 -> 256 -> 64 -> dim`` (ReLU after every layer); one
    ``nn.EmbeddingBag(n_k, dim, mode="sum", sparse=True)`` per table in ``tables``; the "dot"
    interaction of the ``F + 1`` vectors (bottom output and the ``F`` pooled bags): their pairwise
    dot products without self-products, ``(F + 1) F / 2`` of them, next to the bottom output; top MLP
    ``dim + (F + 1) F / 2 -> 512 -> 256 -> 1`` (ReLU between), then a sigmoid. With 26 tables of
    dim 16 the top MLP takes 16 + 351 = 367 features. Train with ``nn.BCELoss``.

    The dense layers are built first and keep torch's own initialisation (their
    ``reset_parameters()``), the tables last, so that a build on the meta device
    (``with torch.device("meta"): ReferenceDLRM(sizes)``) materialised by ``hierps.deepspeed.initialize``
    gets the dense values of an eager build under the same seed. An eager build then draws each table
    uniform in ``±sqrt(1 / n_k)`` (the reference's rule; on the meta device it does nothing, and the
    store's initializer gives the rows).

    Args:
        table_sizes: rows of each table (e.g. ``hierps.demo.data.kaggle_table_sizes()``).
        embedding_dim: ``dim`` of every table; the bottom MLP ends there.
        n_dense: dense features.
        bottom: widths of the bottom MLP's hidden layers (its last layer has ``embedding_dim``).
        top: widths of the top MLP's hidden layers (a last layer to one output follows).
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int = 16,
        n_dense: int = 13,
        bottom: Sequence[int] = (512, 256, 64),
        top: Sequence[int] = (512, 256),
    ) -> None:
        super().__init__()
        if len(table_sizes) < 1 or min(table_sizes) < 1:
            raise ValueError(f"table_sizes: expected positive row counts. Got {tuple(table_sizes)} instead.")
        n_vectors = len(table_sizes) + 1
        self.n_pairs = n_vectors * (n_vectors - 1) // 2
        self.bottom = _mlp(n_dense, (*bottom, embedding_dim), relu_last=True)
        self.top = _mlp(embedding_dim + self.n_pairs, (*top, 1), relu_last=False)
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(int(n), embedding_dim, mode="sum", sparse=True) for n in table_sizes
        )
        with torch.no_grad():
            for table in self.tables:
                table = cast(nn.EmbeddingBag, table)
                bound = 1.0 / math.sqrt(table.num_embeddings)
                table.weight.uniform_(-bound, bound)
        # Not buffers: a meta build would leave them unset, and they are a function of the shape.
        self._pairs: dict[torch.device, torch.Tensor] = {}

    def _pair_index(self, n_vectors: int, device: torch.device) -> torch.Tensor:
        """Flat indices into a ``(V, V)`` Gram matrix of its strict lower triangle, row by row."""
        if device not in self._pairs:
            rows, cols = torch.tril_indices(n_vectors, n_vectors, offset=-1, device="cpu")
            self._pairs[device] = (rows * n_vectors + cols).to(device)
        return self._pairs[device]

    def interact(self, bottom_out: torch.Tensor, pooled: Sequence[torch.Tensor]) -> torch.Tensor:
        """``(B, d)`` bottom output and F ``(B, d)`` pooled bags -> ``(B, d + (F + 1) F / 2)``."""
        vectors = torch.stack([bottom_out, *pooled], dim=1)  # (B, F + 1, d)
        gram = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)  # (B, (F + 1)^2)
        pairs = gram[:, self._pair_index(vectors.shape[1], gram.device)]
        return torch.cat([bottom_out, pairs], dim=1)

    def forward(
        self, dense: torch.Tensor, ids: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """``dense (B, n_dense) float32``; for each table ``k``: ``ids[k] (N_k,) int64`` rows and
        ``offsets[k] (B,) int64`` bag starts -> ``(B,)`` click probabilities (float32)."""
        if len(ids) != len(self.tables) or len(offsets) != len(self.tables):
            raise ValueError(
                f"expected ids and offsets for each of {len(self.tables)} tables. "
                f"Got {len(ids)} ids and {len(offsets)} offsets tensors instead."
            )
        pooled = [table(ids[k], offsets[k]) for k, table in enumerate(self.tables)]
        return torch.sigmoid(self.top(self.interact(self.bottom(dense), pooled)).squeeze(1))

    def sparse_parameters(self) -> Iterator[nn.Parameter]:
        """The tables' weights: sparse gradients."""
        return self.tables.parameters()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """The MLPs' weights and biases, bottom then top: dense gradients."""
        yield from self.bottom.parameters()
        yield from self.top.parameters()

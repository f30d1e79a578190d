"""What the modules and the integrations need of a store: one typed interface.

``hierps.Embedding`` / ``hierps.EmbeddingBag`` (:mod:`hierps.modules`), ``hierps.deepspeed`` and
``hierps.deepspeed.PassLoader`` use a store only through :class:`StoreInterface`. Two stores
implement it: :class:`hierps.Store` (one process) and :class:`hierps.ShardedStore` (keys sharded
over ranks; its methods that move data are collective). ``tests/test_store_conformance.py`` runs
one suite of behaviour against both.

Shapes: ``keys`` are sorted unique int64 ``(U,)`` tensors on the store's device; ``ids`` any
integer tensor, array or list; rows are float32 ``(U, dim)`` on the store's device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Unpack, runtime_checkable

import torch

from hierps.config import TableSettings, TableSpec
from hierps.rows._table import TableInfo

__all__ = ["Bags", "Batches", "Lookup", "StoreInterface", "run_pass"]

# A pass: {table: ids} for the whole pass, or one such mapping per mini-batch, in order.
Batches = Mapping[str, Any] | Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Bags:
    """A pooled table's ids of one announced mini-batch with its bags: ``ids`` (N,) and ``offsets``
    (B,), the two tensors its ``nn.EmbeddingBag`` forward will get.

    Announced this way (``store.begin_pass([{"user": hierps.Bags(ids, offsets)}, ...])``, or from
    a :class:`~hierps.integrations.loader.PassLoader`, which finds offsets in the batch itself), the
    tables of a mini-batch that share a row width are pooled by one ``embedding_bag`` over their
    concatenated bags at the first table's forward, and their gradient summed by one more in the
    backward, even when each table has offsets of its own. Every forward still checks its ids and
    offsets against the announced ones: offsets that differ only cost that table its share of the
    fused call.
    """

    ids: Any
    offsets: Any


@dataclass(frozen=True, slots=True)
class Lookup:
    """How a module's forward reads its ids' rows, checked by the module already.

    ``mode`` None: an ``nn.Embedding`` lookup, ids (...) -> (..., dim). Otherwise an
    ``nn.EmbeddingBag`` pooling (``"sum"``, ``"mean"`` or ``"max"``): ids (N,) with ``offsets``
    (B,) int64 [(B+1,) with ``include_last_offset``], or ids (B, L) and ``offsets`` None -> (B, dim);
    ``per_sample_weights`` float32 like the ids (sum only), not requiring grad. ``padding_idx``: the
    key whose row reads as torch's padding row does (no gradient; pooled as nothing).
    """

    mode: str | None = None
    offsets: torch.Tensor | None = None
    per_sample_weights: torch.Tensor | None = None
    include_last_offset: bool = False
    padding_idx: int | None = None


@runtime_checkable
class StoreInterface(Protocol):
    """A store of tables of rows keyed by raw int64 ids, trained through gathers and steps."""

    @property
    def device(self) -> torch.device:
        """The training device: every gathered row lives there."""
        ...

    @property
    def path(self) -> Path:
        """The store's directory."""
        ...

    @property
    def tables(self) -> dict[str, TableInfo]:
        """The tables by name (dim, optimizer, initializer, life-cycle settings)."""
        ...

    # -- tables and rows ------------------------------------------------------------------------
    def table(
        self, name: str, dim: int, spec: TableSpec | None = None, **settings: Unpack[TableSettings]
    ) -> TableInfo:
        """Create table ``name`` with rows of ``dim`` floats, or reopen it (checking dim, optimizer and
        the precisions ``weights_dtype`` / ``state_dtype`` its rows are stored in). Its settings: a
        :class:`~hierps.config.TableSpec` and / or by keyword (``optimizer=...``), merged by
        :meth:`TableSpec.of <hierps.config.TableSpec.of>`."""
        ...

    def write(self, table: str, keys: Any, weights: Any) -> None:
        """Set the weights of unique int64 ``keys`` (n,) to ``weights`` (n, dim); optimizer state starts afresh."""
        ...

    def lookup(self, table: str, ids: Any) -> torch.Tensor:
        """Current weights of ``ids`` (...) -> (..., dim) float32, without gradient or side effects."""
        ...

    # -- training ---------------------------------------------------------------------------------
    def gather(
        self, table: str, keys: torch.Tensor, *, requires_grad: bool, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of a mini-batch's keys (U,) -> (U, dim); with ``requires_grad`` a leaf :meth:`step` applies."""
        ...

    def gather_planned(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
        """The gather of the next announced mini-batch (translated ahead), or None to gather generically."""
        ...

    def planned_lookup(self, table: str, ids: torch.Tensor, lookup: Lookup) -> torch.Tensor | None:
        """The training forward of ``table``'s next announced mini-batch (its rows gathered with the
        other tables of the mini-batch, its ids translated ahead), as ``lookup`` says: the floats of
        the torch module's forward and, after backward, its gradient for :meth:`step`. None when
        ``ids`` are not the announced ones, or the store cannot do this ``lookup`` this way."""
        ...

    def observe(self, table: str, ids: Any, clicks: Any = None) -> None:
        """Count impressions (and clicks) of ``ids`` (N,) into their rows' show / click counters."""
        ...

    def step(self) -> None:
        """One optimizer step per row gathered since the last step, its gradients summed first."""
        ...

    def zero_grad(self) -> None:
        """Forget what was gathered since the last step."""
        ...

    # -- passes -----------------------------------------------------------------------------------
    def begin_pass(self, batches: Batches) -> None:
        """Load a pass's working set into the device tier before its mini-batches run."""
        ...

    def prefetch(self, batches: Batches) -> None:
        """Announce the next pass, so that its rows are read in the background."""
        ...

    def end_pass(self) -> None:
        """Close the pass (its rows are written back, now or when the next pass begins)."""
        ...

    def run_pass(self, batches: Batches) -> AbstractContextManager[None]:
        """``with store.run_pass(batches): ...`` = begin_pass(batches) ... end_pass()."""
        ...

    # -- durability -------------------------------------------------------------------------------
    def checkpoint(self, tag: str | None = None, *, retire: bool = True) -> int:
        """Make every row written so far durable, atomically; returns the checkpoint id. With
        ``retire`` False, older checkpoints stay until :meth:`retire_checkpoints`."""
        ...

    def retire_checkpoints(self) -> None:
        """Retire the checkpoints beyond ``keep_checkpoints``."""
        ...

    @property
    def keep_checkpoints(self) -> int:
        """How many checkpoints stay restorable."""
        ...

    def restore(self, ref: int | str | None = None) -> int:
        """Return every table to a checkpoint (id, tag, or the latest); returns its id."""
        ...

    def list_checkpoints(self) -> list[dict[str, Any]]:
        """``[{"id", "tag", "created"}, ...]`` of the restorable checkpoints, oldest first."""
        ...

    def num_rows(self, table: str) -> dict[str, int]:
        """Rows of ``table`` per tier: ``{"device", "memory", "ssd"}``."""
        ...

    def close(self) -> None:
        """Release the store; rows not covered by a checkpoint are not made durable."""
        ...


class _Passes(Protocol):
    def begin_pass(self, batches: Batches) -> None: ...
    def end_pass(self) -> None: ...


@contextmanager
def run_pass(store: _Passes, batches: Batches) -> Iterator[None]:
    """``with run_pass(store, batches): ...`` = ``store.begin_pass(batches) ... store.end_pass()``:
    what every store's ``run_pass`` is."""
    store.begin_pass(batches)
    try:
        yield
    finally:
        store.end_pass()

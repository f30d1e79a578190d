"""``hierps.Embedding`` and ``hierps.EmbeddingBag``: drop-ins for the torch modules, rows in a store.

The huge table is never an ``nn.Parameter``: each forward gathers the distinct rows of its ids
from the store's device tier into a small leaf tensor, runs the stock torch kernel on it with
local indices, and leaves the leaf's gradient (already summed per row by autograd) for
:meth:`hierps.Store.step`. So outputs and gradients are the torch ones, row for row.

Example::

    store = hierps.Store("/ssd/hierps", memory_budget="8GiB")
    bag = hierps.EmbeddingBag(None, 16, mode="sum", store=store, name="user",
                              admission={"min_count": 3}, eviction={"ttl_passes": 30, "every_passes": 10})
    out = bag(ids, offsets)          # ids (N,) int64, offsets (B,) -> (B, 16)
    out.sum().backward(); store.step()
    bag.observe(ids, offsets, labels)  # optional: show / click counters from (B,) labels

``admission`` and ``eviction`` (per table; see :class:`hierps.config.AdmissionConfig` and
:class:`hierps.config.EvictionConfig`) say when a new id gets a trained row and when a row is
deleted; by default every id gets a row at first sight and none is ever deleted.
``weights_dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"``) and ``state_dtype`` (``"fp32"``, ``"bf16"``)
are the precisions the table's rows are stored in (see :meth:`hierps.Store.table`); forwards and
gradients stay float32. These six settings may also come as one value, ``spec=hierps.TableSpec.of(...)``,
shared by several modules; a keyword given beside it replaces the spec's setting.

State dicts: a module with ``num_embeddings`` N puts rows 0..N-1 of its table in ``state_dict()`` as
``weight``, the (N, dim) tensor ``nn.Embedding`` would hold, when that is at most
``state_dict_max_bytes`` (256 MiB); a larger or unbounded table, or one the store holds more than N
rows of (fed raw ids beyond 0..N-1), raises :class:`~hierps.errors.NotSupportedError` saying how to
save it (a store checkpoint, and the dense state under :func:`without_tables`). ``load_state_dict``
writes a ``weight`` it finds into the store, so a checkpoint of the plain torch model warm-starts the
hierps one; a state dict without it leaves the store's rows as they are (the store, not the state
dict, holds the rows).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar, Self, Unpack

import torch
import torch.nn.functional as F
from torch import nn

from hierps.config import TableSettings, TableSpec
from hierps.errors import ConfigError, NotSupportedError, OffsetsError
from hierps.interface import Lookup, StoreInterface
from hierps.rows._ids import check_ids_tensor, same_device
from hierps.tiers._slot_index import distinct_ids

__all__ = ["Embedding", "EmbeddingBag", "get_default_store", "set_default_store", "without_tables"]

_default_store: StoreInterface | None = None
# True within without_tables(): state_dict() of the modules holds no table.
_without_tables: ContextVar[bool] = ContextVar("hierps_without_tables", default=False)
_HOW_TO_SAVE = (
    "Save the rows with the store instead: engine.save_checkpoint(dir) under hierps.deepspeed (DeepSpeed's "
    "files and a store checkpoint of the same tag), or store.checkpoint() beside torch.save of the dense "
    "state taken under `with hierps.modules.without_tables(): model.state_dict()`; store.export(dir) "
    "writes the rows for serving."
)


def set_default_store(store: StoreInterface | None) -> None:
    """The store used by modules built without ``store=``."""
    global _default_store
    _default_store = store


def get_default_store() -> StoreInterface:
    if _default_store is None:
        raise ConfigError(
            "no store: pass store=hierps.Store(path, ...) to the module, or call "
            "hierps.set_default_store(store) once before building modules."
        )
    return _default_store


@contextmanager
def without_tables() -> Iterator[None]:
    """Within it, ``state_dict()`` of hierps modules holds no table: the dense state alone.

    For rows saved by other means (a store checkpoint, as ``engine.save_checkpoint`` makes)::

        with hierps.modules.without_tables():
            torch.save(model.state_dict(), "dense.pt")
        store.checkpoint()
    """
    token = _without_tables.set(True)
    try:
        yield
    finally:
        _without_tables.reset(token)


class _StoreEmbedding(nn.Module):
    """What both modules share: the table in the store, id handling and the gather."""

    # (weakref to the last offsets tensor that passed the checks, its version, the ids count)
    _offsets_checked: tuple[weakref.ref[torch.Tensor], int, int] | None = None
    # What from_module copies of the torch module: the arguments that say how ids are read.
    _TORCH_ARGUMENTS: ClassVar[tuple[str, ...]] = (
        "num_embeddings",
        "embedding_dim",
        "padding_idx",
        "max_norm",
        "scale_grad_by_freq",
    )

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        padding_idx: int | None,
        max_norm: float | None,
        scale_grad_by_freq: bool,
        store: StoreInterface | None,
        name: str | None,
        spec: TableSpec,
    ) -> None:
        super().__init__()
        if max_norm is not None:
            raise ConfigError(
                "max_norm is not supported by hierps modules (it rewrites rows during the "
                "forward pass); renormalise in the model instead."
            )
        if scale_grad_by_freq:
            raise ConfigError("scale_grad_by_freq is not supported by hierps modules.")
        if num_embeddings is not None and padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self._store = store if store is not None else get_default_store()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.table = name if name is not None else f"{type(self).__name__.lower()}_{len(self._store.tables)}"
        # A table the store already holds (a resumed run) keeps its rows; a new one is filled.
        self._created = self.table not in self._store.tables
        self._store.table(self.table, embedding_dim, spec)
        if self._created and padding_idx is not None:
            self._store.write(self.table, [padding_idx], torch.zeros(1, embedding_dim))

    @classmethod
    def from_module(
        cls,
        module: nn.Embedding | nn.EmbeddingBag,
        *,
        store: StoreInterface | None = None,
        name: str | None = None,
        overwrite: bool | None = None,
        spec: TableSpec | None = None,
        **settings: Unpack[TableSettings],
    ) -> Self:
        """The hierps twin of a torch module (``hierps.Embedding.from_module(nn.Embedding)``,
        ``hierps.EmbeddingBag.from_module(nn.EmbeddingBag)``), with its arguments (mode, padding_idx,
        ...) and its rows 0..N-1 from ``module.weight``, unless the store already holds the table (a
        resumed run keeps its rows; ``overwrite`` True writes them anyway, False never). ``spec`` and
        the keywords are the table's settings, as for the constructor.

        A module built on the ``meta`` device (``with torch.device("meta"): ...``, a table too large
        to allocate) has no rows: none is copied, nothing of its size is allocated, and each key's
        row comes from the table's initializer when the key is first read. ``nn.Embedding`` and
        ``nn.EmbeddingBag`` initialise their weight N(0, 1), the padding row zero: the store's
        default initializer (``"normal"``, mean 0, std 1) has that distribution and the padding row
        is written zero, but its numbers are drawn from (seed, table, key), not from torch's
        generator: the same distribution as an eager build, not the same numbers. An init the
        model applies itself (``nn.init.uniform_(emb.weight, ...)``) does nothing on the meta
        device; give the table that initializer instead (``initializer={"type": "uniform", ...}``).
        """
        arguments = {attr: getattr(module, attr) for attr in cls._TORCH_ARGUMENTS}
        out = cls(**arguments, store=store, name=name, spec=TableSpec.of(spec, **settings))
        out._load_rows(module.weight, overwrite)
        return out

    @property
    def store(self) -> StoreInterface:
        """The store holding this module's table (a :class:`hierps.Store` or :class:`hierps.ShardedStore`)."""
        return self._store

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (...) int64 -> (..., dim) float32 current rows, no gradient, wherever they live."""
        return self._store.lookup(self.table, ids)

    def _gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """ids: (...) int64 -> (weights (U, dim), local ids (...), local padding index or None)."""
        track = self.training and torch.is_grad_enabled()
        planned = self._store.gather_planned(self.table, ids) if track else None
        if planned is not None:  # the mini-batch was announced: deduplicated and translated ahead
            weights, plan = planned
            keys, local = plan.keys, plan.local.view(ids.shape)
        else:
            keys, local, counts = distinct_ids(ids)
            weights = self._store.gather(self.table, keys, requires_grad=track, counts=counts)
        pad = None
        if self.padding_idx is not None:
            at = int(torch.searchsorted(keys, torch.tensor(self.padding_idx, device=keys.device)).item())
            if at < keys.numel() and int(keys[at].item()) == self.padding_idx:
                pad = at
        return weights, local, pad

    def _load_rows(self, weight: torch.Tensor, overwrite: bool | None) -> None:
        """Rows 0..N-1 from a torch weight, unless the store already holds the table's rows or the
        weight is on the meta device (no rows: the initializer gives them)."""
        if weight.is_meta:
            if overwrite:
                raise ConfigError(
                    f"table {self.table!r}: overwrite=True, but the weight given is on the meta device "
                    f"(shape {tuple(weight.shape)}) and holds no rows to write. Build the module on a real "
                    "device to copy its rows in, or leave overwrite unset: a new table's rows then come "
                    "from its initializer, and a table the store holds keeps its rows."
                )
            return
        if overwrite if overwrite is not None else self._created:
            n = weight.shape[0]
            self._store.write(self.table, torch.arange(n), weight.detach().to(torch.float32).cpu())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}"

    # -- state dicts: the table as the torch module's weight, where one can hold it -------------
    # The largest table state_dict() copies out whole (rows x dim x 4 bytes): a state dict lives in
    # memory at once, and a table past this is what the store is for.
    state_dict_max_bytes: int = 256 * 2**20

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not _without_tables.get():
            destination[prefix + "weight"] = self._table_weight(prefix + "weight")

    def _table_weight(self, key: str) -> torch.Tensor:
        """Rows 0..N-1 of the table: (N, dim) float32, as ``nn.Embedding.weight``; or why there is none."""
        what = f"state_dict: {key!r} is table {self.table!r} of a hierps.{type(self).__name__}"
        n, world = self.num_embeddings, getattr(self._store, "world_size", 1)
        if n is None:
            raise NotSupportedError(
                f"{what} built with num_embeddings=None: any int64 id has a row, so no (N, "
                f"{self.embedding_dim}) weight holds them. {_HOW_TO_SAVE}"
            )
        if world > 1:
            raise NotSupportedError(
                f"{what}, its rows sharded over {world} ranks (reading them is collective). {_HOW_TO_SAVE}"
            )
        size = n * self.embedding_dim * 4
        if size > self.state_dict_max_bytes:
            raise NotSupportedError(
                f"{what}: {n:,} rows x {self.embedding_dim} float32 = {size / 2**20:,.1f} MiB, more than "
                f"state_dict_max_bytes = {self.state_dict_max_bytes / 2**20:,.1f} MiB (raise it on the "
                f"module to copy it out anyway). {_HOW_TO_SAVE}"
            )
        held = max(self._store.num_rows(self.table).values())
        if held > n:
            raise NotSupportedError(
                f"{what}: the store holds {held:,} rows of it, more than num_embeddings={n:,}: its ids are "
                f"not 0..{n - 1}, so a weight of {n:,} rows would leave rows out. {_HOW_TO_SAVE}"
            )
        return self.lookup(torch.arange(n))

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        weight = state_dict.get(key)
        if weight is not None:  # a torch module's weight (a warm start) or one state_dict() wrote
            expected = (self.num_embeddings, self.embedding_dim)
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
            if (
                shape is None
                or len(shape) != 2
                or shape[1] != self.embedding_dim
                or self.num_embeddings not in (None, shape[0])
            ):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, the "
                    f"table {self.table!r} in the store has rows of {expected[1]} floats"
                    + (f" and num_embeddings {expected[0]}." if expected[0] is not None else ".")
                )
            else:
                self._load_rows(weight, overwrite=True)
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def __getstate__(self) -> dict[str, Any]:
        raise NotSupportedError(
            f"a hierps.{type(self).__name__} (table {self.table!r}) cannot be pickled (torch.save(model), "
            "copy.deepcopy): its rows live in an open store. torch.save(model.state_dict()) holds tables of "
            f"up to state_dict_max_bytes. {_HOW_TO_SAVE}"
        )


class Embedding(_StoreEmbedding):
    """Like ``nn.Embedding``; rows keyed by raw int64 ids and kept in a :class:`hierps.Store`.

    ``num_embeddings`` may be None: any int64 id is a key, negative ones included.
    forward: ids (...) int64 on the store's device -> (..., embedding_dim) float32.
    Keyword-only: ``store``, ``name`` (of the table) and the table's settings, a ``spec``
    (:class:`hierps.TableSpec`) and / or ``optimizer=``, ``initializer=``, ``admission=``,
    ``eviction=``, ``weights_dtype=``, ``state_dtype=`` (see :meth:`hierps.Store.table`).
    """

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = True,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        *,
        store: StoreInterface | None = None,
        name: str | None = None,
        spec: TableSpec | None = None,
        **settings: Unpack[TableSettings],
    ) -> None:
        if _freeze:  # before the table is created in the store
            raise ConfigError(
                "frozen embeddings (_freeze=True) belong in a plain nn.Embedding, not the store."
            )
        spec = TableSpec.of(spec, **settings)
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, max_norm, scale_grad_by_freq, store, name, spec
        )
        if _weight is not None:
            self._load_rows(_weight, overwrite=None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ids = check_ids_tensor(input, self._store.device, what=f"ids of {self.table!r}")
        if self.training and torch.is_grad_enabled():
            looked_up = self._store.planned_lookup(self.table, ids, Lookup(padding_idx=self.padding_idx))
            if looked_up is not None:  # announced: rows gathered with the mini-batch's other tables
                return looked_up
        weights, local, pad = self._gather(ids)
        # A sparse gradient of the gathered rows is cheaper to produce than a dense one.
        return F.embedding(local, weights, padding_idx=pad, sparse=True)

    def observe(self, input: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Count impressions (and clicks) of a batch: input (B, ...) int64, labels (B,) 0/1 or None.

        Each example's label goes to every id of its row of ``input``; see :meth:`hierps.Store.observe`.
        """
        ids = check_ids_tensor(input, self._store.device, what=f"ids of {self.table!r}")
        clicks = None
        if labels is not None:
            if ids.dim() == 0 or labels.shape != ids.shape[:1]:
                raise ConfigError(
                    f"labels of shape {tuple(labels.shape)} for input of shape {tuple(ids.shape)}; "
                    "expected one label per example, shape (B,)."
                )
            clicks = labels.reshape(-1, *([1] * (ids.dim() - 1))).expand(ids.shape)
        self._store.observe(self.table, ids, clicks)


class EmbeddingBag(_StoreEmbedding):
    """Like ``nn.EmbeddingBag`` (mode sum / mean / max, offsets, per_sample_weights, padding_idx).

    forward: input (N,) int64 with offsets (B,) [or (B+1,) with include_last_offset], or input
    (B, L) without offsets -> (B, embedding_dim) float32; per_sample_weights like input (sum only).
    Keyword-only: ``store``, ``name`` (of the table) and the table's settings, a ``spec``
    (:class:`hierps.TableSpec`) and / or ``optimizer=``, ``initializer=``, ``admission=``,
    ``eviction=``, ``weights_dtype=``, ``state_dtype=`` (see :meth:`hierps.Store.table`).
    """

    _TORCH_ARGUMENTS = (*_StoreEmbedding._TORCH_ARGUMENTS, "mode", "include_last_offset")

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = True,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        *,
        store: StoreInterface | None = None,
        name: str | None = None,
        spec: TableSpec | None = None,
        **settings: Unpack[TableSettings],
    ) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ConfigError(f"mode: expected 'sum', 'mean' or 'max'. Got {mode!r} instead.")
        spec = TableSpec.of(spec, **settings)
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, max_norm, scale_grad_by_freq, store, name, spec
        )
        self.mode = mode
        self.include_last_offset = include_last_offset
        if _weight is not None:
            self._load_rows(_weight, overwrite=None)

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids = check_ids_tensor(input, self._store.device, what=f"ids of {self.table!r}")
        offsets = self._check_offsets(ids, offsets)
        if per_sample_weights is not None:
            per_sample_weights = _check_weights(per_sample_weights, self._store.device)
            if per_sample_weights.shape != ids.shape:
                raise OffsetsError(
                    f"per_sample_weights of shape {tuple(per_sample_weights.shape)} do not match "
                    f"ids of shape {tuple(ids.shape)}."
                )
            if self.mode != "sum":
                raise ConfigError(
                    f"per_sample_weights need mode='sum' (torch's rule). Got mode {self.mode!r}."
                )
        if (
            self.training
            and torch.is_grad_enabled()
            and (per_sample_weights is None or not per_sample_weights.requires_grad)
        ):
            lookup = Lookup(
                self.mode, offsets, per_sample_weights, self.include_last_offset, self.padding_idx
            )
            pooled = self._store.planned_lookup(self.table, ids, lookup)
            if pooled is not None:  # announced: rows gathered with the mini-batch's other tables
                return pooled
        weights, local, pad = self._gather(ids)
        return F.embedding_bag(
            local,
            weights,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=pad,
            sparse=self.mode != "max",
        )

    def observe(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> None:
        """Count impressions (and clicks) of a batch of bags, as :meth:`forward` takes them.

        input (N,) int64 with offsets (B,) [or (B+1,)], or input (B, L); labels (B,) 0/1 per bag
        or None. Each bag's label goes to each of its ids; see :meth:`hierps.Store.observe`.
        """
        ids = check_ids_tensor(input, self._store.device, what=f"ids of {self.table!r}")
        offsets = self._check_offsets(ids, offsets)
        clicks = None
        if labels is not None:
            bags = ids.shape[0] if offsets is None else offsets.numel() - int(self.include_last_offset)
            if labels.shape != (bags,):
                raise ConfigError(
                    f"labels of shape {tuple(labels.shape)} for {bags} bags; expected one label per "
                    f"bag, shape ({bags},)."
                )
            if offsets is None:
                clicks = labels.reshape(-1, 1).expand(ids.shape)
            else:
                starts = offsets[:-1] if self.include_last_offset else offsets
                ends = (
                    offsets[1:]
                    if self.include_last_offset
                    else torch.cat([offsets[1:], offsets.new_tensor([ids.numel()])])
                )
                clicks = torch.repeat_interleave(labels, ends - starts)
        self._store.observe(self.table, ids, clicks)

    def _check_offsets(self, ids: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor | None:
        if ids.dim() == 2:
            if offsets is not None:
                raise OffsetsError("offsets must be None when input is 2D (B, L): each row is one bag.")
            return None
        if ids.dim() != 1:
            raise OffsetsError(f"input must be 1D (with offsets) or 2D (B, L). Got shape {tuple(ids.shape)}.")
        if offsets is None:
            raise OffsetsError(
                "1D input needs offsets: the start of each bag in input, e.g. torch.tensor([0, 3])."
            )
        if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32):
            raise OffsetsError(
                f"offsets must be an int64 tensor. Got {getattr(offsets, 'dtype', type(offsets))}."
            )
        if offsets.dim() != 1 or not same_device(offsets.device, ids.device):
            raise OffsetsError(
                f"offsets must be 1D and on the device of the ids ({ids.device}). Got shape "
                f"{tuple(offsets.shape)} on {offsets.device}."
            )
        n = ids.numel()
        seen = _StoreEmbedding._offsets_checked
        if seen is not None and seen[0]() is offsets and seen[1:] == (offsets._version, n):
            return offsets.long()  # the same offsets object, unchanged, checked for as many ids
        if offsets.numel():
            if offsets.device.type == "cpu" and not offsets.requires_grad:  # numpy: a few µs, no kernels
                o = offsets.numpy()
                bad = [o[0] != 0, bool((o[1:] < o[:-1]).any()), o[-1] > n]
            else:
                checks = torch.stack([offsets[0] != 0, (offsets[1:] < offsets[:-1]).any(), offsets[-1] > n])
                bad = checks.tolist()
            if bad[0]:
                raise OffsetsError(f"offsets must start at 0. Got offsets[0] = {int(offsets[0])}.")
            if bad[1]:
                raise OffsetsError(
                    "offsets must be non-decreasing (each bag starts where the last one ended)."
                )
            if bad[2]:
                raise OffsetsError(
                    f"offsets point past the end of input: last offset {int(offsets[-1])} > {n} ids."
                )
        # A model usually hands one offsets tensor to all its tables: check it once.
        _StoreEmbedding._offsets_checked = (weakref.ref(offsets), offsets._version, n)
        return offsets.long()


def _check_weights(weights: Any, device: torch.device) -> torch.Tensor:
    """``per_sample_weights``: a real floating tensor on ``device`` -> float32 (the rows' dtype)."""
    if not isinstance(weights, torch.Tensor) or weights.layout != torch.strided:
        raise OffsetsError(
            f"per_sample_weights: expected a dense float tensor like the ids. Got {type(weights).__name__}"
            f"{'' if not isinstance(weights, torch.Tensor) else f' of layout {weights.layout}'}."
        )
    if not weights.dtype.is_floating_point:
        raise OffsetsError(f"per_sample_weights: expected a float tensor. Got dtype {weights.dtype}.")
    if not same_device(weights.device, device):
        raise OffsetsError(f"per_sample_weights: on {weights.device}, the store trains on {device}.")
    return weights.to(torch.float32)

"""Reading and writing rows of a store by key, wherever they live: the part behind
:meth:`hierps.Store.lookup`, :meth:`~hierps.Store.read_rows`, :meth:`~hierps.Store.write` and
:meth:`~hierps.Store.write_rows`.

Reads look in the device tier, then RAM, SSD and the initializer, and change no tier. Writes wait
for the pipeline, then update rows resident in the device tier in place (marked dirty) and put the
rest into the RAM tier as dirty rows, which a checkpoint makes durable.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hierps._core import StoreCore
from hierps.errors import ConfigError
from hierps.rows import _ids
from hierps.rows._optim import state_parts
from hierps.rows._table import TableInfo
from hierps.training._pipeline import PassPipeline
from hierps.training._trainer import SparseTrainer

__all__ = ["RowAccess", "real_array"]

_FRESH_ROWS = 1 << 14  # rows made afresh per step of a write: its temporaries stay in cache
# Rows gathered (sorted) and encoded per step of write_rows: the caller's array is never copied whole.
_ENCODE_ROWS = 1 << 18
# A write_rows of at least this many bytes of rows, more than the RAM tier has room for, in a key
# range no tier holds a key of, is a bulk load: written straight to the SSD tier as one segment.
INGEST_BYTES = 32 << 20
_LAST_KEY = int(np.iinfo(np.int64).max)


class RowAccess:
    """Rows of a store's tables by key: lookups, whole-row reads, writes, and forgetting a table."""

    def __init__(self, core: StoreCore, pipe: PassPipeline, trainer: SparseTrainer) -> None:
        self.core = core
        self.pipe = pipe
        self.trainer = trainer

    def lookup(self, table: str, ids: Any) -> torch.Tensor:
        """ids: (...) integer tensor, array or list -> (..., dim) float32 weights on the store's device."""
        info = self.core.info(table)
        flat = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
        shape = tuple(ids.shape) if hasattr(ids, "shape") else (len(flat),)
        keys, inverse, rows = self.core.unique_rows(table, flat)
        weights = np.ascontiguousarray(rows[:, : info.dim])
        if info.admission.unknown_rows == "zeros" and len(keys):
            weights[~self.core.has_row(table, keys)] = 0.0
        return torch.from_numpy(weights[inverse]).reshape(*shape, info.dim).to(self.core.device)

    def read_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys (n,) int64 -> (n, dim + state) float32: weights and optimizer state, decoded."""
        return self.core.whole_rows(table, keys)[:, : self.core.info(table).state_end]

    def write(self, table: str, keys: Any, weights: Any) -> None:
        """Set the weights of unique ``keys`` (n,) to ``weights`` (n, dim); optimizer state starts afresh.

        Streams at memory speed: keys already sorted (rows 0..n-1 of a torch module) are neither
        sorted nor copied, the stored rows are made a cache-sized slice at a time into one array,
        and the RAM tier takes them in one call (grown once, its index merged once; what exceeds
        its budget goes on to the SSD tier in one batch)."""
        core = self.core
        info, keys, w = self._checked("write", table, keys, weights, "weights", "dim")
        order = None if _ids.strictly_increasing(keys) else np.argsort(keys, kind="stable")
        if order is not None:
            _refuse_repeats("write", table, keys, order)
        self.pipe.drain()
        if order is not None:
            keys = keys[order]
        rows = np.empty((len(keys), info.words), np.float32)
        for start in range(0, len(keys), _FRESH_ROWS):
            part = slice(start, start + _FRESH_ROWS)
            given = w[part] if order is None else w[order[part]]
            rows[part] = info.fresh_rows(keys[part], core.passes, given.astype(np.float32, copy=False))
        core.pending_keys[table].remove(keys)
        found, slots = core.device_tier.resolve(table, torch.from_numpy(keys).to(core.device))
        if found.any():
            f_np = found.cpu().numpy()
            core.device_tier.rows(table)[slots[found]] = torch.from_numpy(rows[f_np]).to(core.device)
            core.device_tier.mark_dirty(table, slots[found])
            keys, rows = keys[~f_np], rows[~f_np]
        core.memory.put(table, keys, rows, dirty=True)

    def write_rows(self, table: str, keys: Any, rows: Any) -> None:
        """Set whole decoded rows (n, width) of unique ``keys`` (n,), stored in the table's precisions.

        Refused (``ConfigError``, nothing written) when a key repeats, a value is NaN or inf, or a
        sum of squared gradients in the optimizer state is negative; each check reads the rows a
        slice at a time, so memory stays bounded however many rows are written."""
        core = self.core
        info, keys, rows = self._checked("write_rows", table, keys, rows, "rows", "width")
        order = None if _ids.strictly_increasing(keys) else np.argsort(keys, kind="stable")
        if order is not None:
            _refuse_repeats("write_rows", table, keys, order)
        _refuse_bad_rows(info, rows)
        self.pipe.drain()
        core.device_tier.discard(table)
        steps = [
            slice(start, start + _ENCODE_ROWS) if order is None else order[start : start + _ENCODE_ROWS]
            for start in range(0, len(keys), _ENCODE_ROWS)
        ]

        def encoded() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for part in steps:
                yield keys[part], info.layout.encode_np(np.ascontiguousarray(rows[part], dtype=np.float32))

        if self._ingest(info, keys, order, encoded):
            return
        for part_keys, part_rows in encoded():
            core.memory.put(table, part_keys, part_rows, dirty=True)

    def _ingest(
        self,
        info: TableInfo,
        keys: np.ndarray,
        order: np.ndarray | None,
        encoded: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]],
    ) -> bool:
        """Write a bulk load (see :data:`INGEST_BYTES`) straight to the SSD tier as one segment, the
        rows sorted and encoded a step at a time (``encoded()``), written once: the RAM tier would
        only pass them on, a step at a time, as segments that compaction rewrites. True when done;
        False when the write is no bulk load, or when the SSD tier refused it (``OSError``, e.g. a
        full disk: it stored none of it; the caller's RAM tier takes the rows as ever, keeping them
        over budget if it must)."""
        core, table = self.core, info.name
        n, row_bytes = len(keys), core.memory.row_bytes(table)
        room = core.memory.budget - core.memory.bytes_used
        if n * 4 * info.words < INGEST_BYTES or n * row_bytes <= room:
            return False
        lo, hi = (
            (int(keys[0]), int(keys[-1])) if order is None else (int(keys[order[0]]), int(keys[order[-1]]))
        )
        if core.memory.holds_between(table, lo, hi) or not core.ssd.disjoint(table, lo, hi):
            return False
        try:
            core.ssd.ingest(table, encoded(), n, lo, hi)
        except OSError:
            return False
        core.ssd.settle(table)
        return True

    def ingest_sorted(self, table: str, parts: Iterator[tuple[np.ndarray, np.ndarray]], expected: int) -> int:
        """Write whole decoded rows arriving in ascending key order into ``table``, which holds no row
        (e.g. just :meth:`reset`), straight to the SSD tier as one segment, written once: ``parts``
        yields ``(keys (k,) int64 strictly increasing, all above the previous part's, rows (k, width)
        float32)``, each encoded in the table's precisions as it comes (``expected``: about how many
        rows, for a full disk's message). Like the rows of any write, they are durable at the next
        checkpoint. Returns the rows written (none: no segment). Raises what the SSD tier raises
        (e.g. ``StoreFullError``), having stored none of them."""
        core = self.core
        core.check_open()
        info = core.info(table)
        self.pipe.drain()
        first = next(parts, None)
        if first is None:
            return 0
        lo = int(first[0][0])
        if core.memory.holds_between(table, lo, _LAST_KEY) or not core.ssd.disjoint(table, lo, _LAST_KEY):
            raise ValueError(f"table {table!r}: rows ingested in order into a table that holds rows")
        core.device_tier.discard(table)
        n = 0

        def encoded() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            nonlocal n
            for keys, rows in itertools.chain([first], parts):
                n += len(keys)
                yield keys, info.layout.encode_np(np.ascontiguousarray(rows, dtype=np.float32))

        core.ssd.ingest(table, encoded(), max(expected, 1), lo, _LAST_KEY)
        core.ssd.settle(table)
        return n

    def _checked(
        self, what: str, table: str, keys: Any, data: Any, name: str, columns: str
    ) -> tuple[TableInfo, np.ndarray, np.ndarray]:
        """The checks of a write: an open store, a known table, int64 keys (n,) and real ``data``
        of shape (n, the table's ``columns``: "dim" or "width"); ``ConfigError`` saying what was
        found otherwise."""
        self.core.check_open()
        info = self.core.info(table)
        keys = _ids.as_int64_array(keys, what="keys")
        arr = real_array(data, f"{what} to {table!r}: {name}")
        expected = (len(keys), int(getattr(info, columns)))
        if arr.shape != expected:
            raise ConfigError(
                f"{what} to {table!r}: {name} of shape {arr.shape} for {len(keys)} keys of {columns} "
                f"{expected[1]}; expected {expected}."
            )
        return info, keys, arr

    def reset(self, table: str) -> None:
        """Forget every row of ``table`` in every tier (checkpoints keep theirs) and its step count."""
        core = self.core
        core.check_open()
        info = core.info(table)
        self.pipe.drain()
        self.trainer.drop(table)
        core.device_tier.discard(table)
        core.memory.discard(table)
        core.ssd.reset(table)
        info.step = 0


def _refuse_repeats(what: str, table: str, keys: np.ndarray, order: np.ndarray) -> None:
    """``ConfigError`` naming a key that appears twice in ``keys`` (n,), sorted by ``order`` (n,);
    the sorted keys are compared a slice at a time (no sorted copy of them all)."""
    last = None
    for start in range(0, len(order), _ENCODE_ROWS):
        run = keys[order[start : start + _ENCODE_ROWS]]
        if last is not None:
            run = np.concatenate([last, run])
        same = np.flatnonzero(run[1:] == run[:-1])
        if len(same):
            raise ConfigError(
                f"{what} to {table!r}: keys must be unique; key {int(run[same[0]])} appears more than "
                "once. Pass each key once (with the row it should end with)."
            )
        last = run[-1:]


# State parts that sum (or average) squared gradients: never negative, or a step takes the square
# root of a negative number (see hierps.rows._optim).
_SQUARED_STATE = frozenset({"sum", "exp_avg_sq", "n"})


def _refuse_bad_rows(info: TableInfo, rows: np.ndarray) -> None:
    """``ConfigError`` for decoded ``rows`` (n, width) holding a NaN or inf anywhere, or a negative
    value in a part of the optimizer state that sums squared gradients; read a slice at a time."""
    squared, column = [], info.dim
    for name, count, _ in state_parts(info.optimizer.type, info.dim):
        if name in _SQUARED_STATE:
            squared.append((name, column, column + count))
        column += count
    for start in range(0, len(rows), _ENCODE_ROWS):
        part = rows[start : start + _ENCODE_ROWS]
        with np.errstate(over="ignore"):  # float64 beyond float32's range: inf once stored
            bad = ~np.isfinite(part.astype(np.float32, copy=False))
        if bad.any():
            row, col = (int(i[0]) for i in np.nonzero(bad))
            raise ConfigError(
                f"write_rows to {info.name!r}: row {start + row} holds {part[row, col]} in column {col}; "
                "rows must be finite float32 (weights, optimizer state and counters). Nothing was written."
            )
        for name, a, b in squared:
            negative = part[:, a:b] < 0
            if negative.any():
                row, col = (int(i[0]) for i in np.nonzero(negative))
                raise ConfigError(
                    f"write_rows to {info.name!r}: row {start + row} holds {part[row, a + col]} in column "
                    f"{a + col}, its {info.optimizer.type} state {name!r}: a sum of squared gradients, "
                    "which cannot be negative. Nothing was written; pass the state a row was read with "
                    "(read_rows) or 0."
                )


def real_array(data: Any, what: str) -> np.ndarray:
    """A tensor, array or nested list of real numbers -> a numpy array; ``ConfigError`` otherwise."""
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu()
        if data.is_sparse:
            data = data.to_dense()
        if data.dtype == torch.bfloat16:
            data = data.float()
    try:
        arr = np.asarray(data.numpy() if isinstance(data, torch.Tensor) else data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what}: expected an array of real numbers. Got {type(data).__name__} ({exc})."
        ) from exc
    if arr.dtype.kind not in "iuf":
        raise ConfigError(
            f"{what}: expected an array of real numbers (float32). Got dtype {arr.dtype}; convert it first."
        )
    return arr

"""Bytes per row in each tier, from the store's own layout and file-format code.

Nothing here is a copied constant: a row's words come from :func:`hierps.rows.row_layout`, the
device and RAM tiers' charge per row from the tiers themselves, and the bytes a segment takes on
disk from writing two small segments with the SSD tier's own writer
(:class:`hierps.storage.SegmentWriter`) and fitting ``bytes = fixed + per_row * n``: chunk
padding, checksums, fences, the key filter and metadata all included, as the format has them.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from zarr.storage import LocalStore

from hierps.config import TableSpec
from hierps.rows import row_layout
from hierps.storage import SegmentWriter
from hierps.storage._filter import filter_bits
from hierps.storage._segment import TRAILER, chunk_rows_for, stored_row_bytes
from hierps.tiers import ram_row_bytes
from hierps.tiers._device import ROW_OVERHEAD

__all__ = ["RowBytes", "row_bytes", "segment_bytes"]


@dataclass(frozen=True)
class RowBytes:
    """What one row of a table costs in each tier, in bytes."""

    words: int
    """4-byte words of a stored row (weights, optimizer state, counters; the same in every tier)."""
    device: float
    """Device tier: the row and its slot bookkeeping."""
    ram: float
    """RAM tier: the row and its key, slot, score and dirty bit (charged against ``memory_budget``)."""
    ssd: float
    """SSD tier, per live row in a large segment: row, key, chunk padding and checksums, fences, filter."""
    ssd_fixed: float
    """SSD tier, per segment: metadata and shard index that do not grow with the rows."""
    index: float
    """RAM the SSD tier holds per stored row to find it (fences and filter)."""
    ssd_traffic: int
    """Bytes the SSD tier counts per row read (``ssd_bytes_read``): the stored row."""
    ssd_written: int
    """Bytes the SSD tier counts per row written (``ssd_bytes_written``): the row and its key."""
    chunk_pages: int
    """4 KiB pages of the chunk a row lies in: what one row read fetches (one page, unless rows are
    so wide that a chunk of the fewest rows spans several)."""

    def to_json(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


def row_bytes(dim: int, spec: TableSpec) -> RowBytes:
    """The bytes per row of a table of ``dim`` weights with the settings of ``spec`` (None settings:
    the store's defaults, adagrad and fp32)."""
    opt = spec.optimizer.type if spec.optimizer is not None else "adagrad"
    layout = row_layout(opt, dim, spec.weights_dtype or "fp32", spec.state_dtype or "fp32")
    words = layout.words
    fixed, per_row = segment_bytes(words)
    chunk = chunk_rows_for(words)
    return RowBytes(
        words=words,
        device=float(4 * words + ROW_OVERHEAD),
        ram=float(ram_row_bytes(words)),
        ssd=per_row,
        ssd_fixed=fixed,
        index=8 / chunk + filter_bits(chunk) / 8,
        ssd_traffic=4 * words,
        ssd_written=stored_row_bytes(words),
        chunk_pages=-(-(chunk * stored_row_bytes(words) + TRAILER) // 4096),
    )


@cache
def segment_bytes(words: int) -> tuple[float, float]:
    """(fixed bytes per segment, bytes per row) of segments of rows of ``words`` words, measured by
    writing two segments (64 and 192 chunks of rows) with the SSD tier's writer in a temp folder."""
    chunk = chunk_rows_for(words)
    sizes = (64 * chunk, 192 * chunk)
    measured = []
    with tempfile.TemporaryDirectory(prefix="hierps-plan-") as tmp:
        root = Path(tmp)
        zstore = LocalStore(str(root))
        for i, n in enumerate(sizes):
            name = f"t/{i:08d}"
            writer = SegmentWriter(zstore, root, name, words, store_id="plan")
            keys = np.arange(1, n + 1, dtype=np.int64) * 7919
            writer.append(keys, np.zeros((n, words), np.float32))
            writer.close()
            measured.append(_tree_bytes(root / name))
    per_row = (measured[1] - measured[0]) / (sizes[1] - sizes[0])
    return measured[0] - per_row * sizes[0], per_row


def _tree_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)

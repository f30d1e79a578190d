"""The compiled core of the storage layer, or the numpy code it replaces.

:mod:`._core` (``_core.c``, built by ``setup.py`` at install) runs the loops over bytes of the SSD
tier: crc32c (with the CPU's crc32 instruction where it has one), planning reads and checking what they
bring (crc32c and binding tag of every chunk) while gathering the wanted rows out of it in one pass,
encoding chunks for writing, building and probing the key filters, and merging sorted runs; and the
device tier's key -> slot hash index on the CPU (:mod:`hierps.tiers._slot_index`, whose fallback is the
tier's sorted index). Each function computes exactly what the numpy code it replaces computes, and that code
stays beside its caller (:mod:`hierps.storage._reads`, :mod:`hierps.storage._arrays`,
:mod:`hierps.storage._filter`, :mod:`hierps.storage._merge`): it runs where
the extension could not be built (a machine without a C compiler; hierps then warns once) or where
``HIERPS_NATIVE=0`` is set, and the tests hold the two to the same results.

Every compiled function releases the GIL while it loops, so the read threads check and gather on
every core while training goes on.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import crc32c as _crc32c
import numpy as np

from hierps.rows import _ids

try:
    from hierps.storage._native import _core
except ImportError as exc:  # built without a C compiler: the numpy code serves
    _core = None  # type: ignore[assignment]
    _MISSING: str | None = str(exc)
else:
    _MISSING = None

if TYPE_CHECKING:
    Buffer = _core.Buffer  # what the compiled functions take (the buffer protocol)

__all__ = [
    "binding_tags",
    "bloom_add",
    "bloom_may_contain",
    "check_gather",
    "crc32c",
    "disabled",
    "enabled",
    "encode_chunks",
    "find_sorted",
    "group_ids",
    "hardware_crc",
    "index_add_rows",
    "insert_sorted",
    "match_rows",
    "merge_runs",
    "plan_chunks",
    "plan_runs",
    "read_check_gather",
    "slot_drop",
    "slot_find",
    "slot_put",
    "unique_ids",
]

_on = _core is not None and os.environ.get("HIERPS_NATIVE", "1") != "0"

if _MISSING is not None and os.environ.get("HIERPS_NATIVE", "1") != "0":
    warnings.warn(
        f"hierps: the compiled core of the SSD tier (hierps.storage._native._core) could not be imported "
        f"({_MISSING}); its reads and writes run in numpy, several times slower. Reinstall hierps where a C "
        "compiler is present (`pip install .`, or `make setup`), or set HIERPS_NATIVE=0 to silence this.",
        RuntimeWarning,
        stacklevel=2,
    )


def enabled() -> bool:
    """Whether the compiled core serves (it is importable, and ``HIERPS_NATIVE`` is not ``0``)."""
    return _on


def hardware_crc() -> bool:
    """Whether crc32c runs on the CPU's crc32 instruction (the compiled core's, or the crc32c package's)."""
    return _core.hardware() if _on else bool(_crc32c.hardware_based)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the numpy code inside the block (benchmarks and tests compare the two in one process)."""
    global _on
    was, _on = _on, False
    try:
        yield
    finally:
        _on = was


def crc32c(data: Buffer, value: int = 0) -> int:
    """The crc32c of ``data``'s bytes continuing ``value`` (``crc32c.crc32c(data, value)``)."""
    if _on:
        return _core.crc32c(data, value)
    return int(_crc32c.crc32c(data, value))  # type: ignore[arg-type]  # an ndarray is a buffer


def check_gather(
    buf: Buffer,
    at: Buffer,
    chunks: Buffer,
    payload: int,
    seed: int,
    pos: Buffer,
    chunk_rows: int,
    row_bytes: int,
    out: Buffer | None,
    slot: Buffer | None = None,
) -> tuple[int, int, int, int]:
    """:func:`._core.check_gather` (the compiled core only: callers check :func:`enabled` first)."""
    return _core.check_gather(buf, at, chunks, payload, seed, pos, chunk_rows, row_bytes, out, slot)


def plan_chunks(pos: Buffer, chunk_rows: int, n: int, chunks: Buffer) -> tuple[int, int, int, int]:
    """:func:`._core.plan_chunks` (the compiled core only)."""
    return _core.plan_chunks(pos, chunk_rows, n, chunks)


def plan_runs(
    start: Buffer,
    file: Buffer,
    chunk_bytes: int,
    gap: int,
    piece: int,
    at: Buffer,
    run_chunk: Buffer,
    run_file: Buffer,
    run_start: Buffer,
    run_dest: Buffer,
    pos: Buffer | None,
    chunks: Buffer | None,
    chunk_rows: int,
    run_row: Buffer | None,
) -> int:
    """:func:`._core.plan_runs` (the compiled core only)."""
    return _core.plan_runs(
        start, file, chunk_bytes, gap, piece, at, run_chunk, run_file, run_start, run_dest, pos, chunks,
        chunk_rows, run_row,
    )  # fmt: skip


def read_check_gather(
    fds: Buffer,
    run_start: Buffer,
    run_dest: Buffer,
    run_chunk: Buffer,
    run_row: Buffer,
    first: int,
    stop: int,
    scratch: Buffer,
    at: Buffer,
    chunks: Buffer,
    pos: Buffer,
    payload: int,
    seed: int,
    chunk_rows: int,
    row_bytes: int,
    out: Buffer,
    cached: bool = False,
) -> tuple[int, int, int, int, int, int]:
    """:func:`._core.read_check_gather` (the compiled core only)."""
    return _core.read_check_gather(
        fds, run_start, run_dest, run_chunk, run_row, first, stop, scratch, at, chunks, pos, payload, seed,
        chunk_rows, row_bytes, out, cached,
    )  # fmt: skip


def bloom_add(filt: Buffer, keys: Buffer) -> None:
    """:func:`._core.bloom_add` (the compiled core only)."""
    _core.bloom_add(filt, keys)


def bloom_may_contain(filt: Buffer, keys: Buffer, block: Buffer | None, full_words: int, out: Buffer) -> None:
    """:func:`._core.bloom_may_contain` (the compiled core only)."""
    _core.bloom_may_contain(filt, keys, block, full_words, out)


def merge_runs(
    keys: list[Buffer],
    rows: list[Buffer],
    ranks: Buffer,
    newest_only: bool,
    out_keys: Buffer,
    out_rows: Buffer,
    out_src: Buffer,
) -> int:
    """:func:`._core.merge_runs` (the compiled core only)."""
    return _core.merge_runs(keys, rows, ranks, newest_only, out_keys, out_rows, out_src)


def encode_chunks(
    rows: Buffer, chunk_rows: int, first: int, seed: int, stride: int, out: Buffer, content: int
) -> int:
    """:func:`._core.encode_chunks` (the compiled core only)."""
    return _core.encode_chunks(rows, chunk_rows, first, seed, stride, out, content)


def binding_tags(chunks: Buffer, crcs: Buffer, seed: int, out: Buffer) -> None:
    """:func:`._core.binding_tags` (the compiled core only)."""
    _core.binding_tags(chunks, crcs, seed, out)


def slot_find(index: Buffer, keys: Buffer, slots: Buffer, found: Buffer) -> int:
    """:func:`._core.slot_find` (the compiled core only)."""
    return _core.slot_find(index, keys, slots, found)


def slot_put(index: Buffer, used: int, keys: Buffer, slots: Buffer) -> int:
    """:func:`._core.slot_put` (the compiled core only)."""
    return _core.slot_put(index, used, keys, slots)


def slot_drop(index: Buffer, keys: Buffer) -> int:
    """:func:`._core.slot_drop` (the compiled core only)."""
    return _core.slot_drop(index, keys)


def match_rows(
    block: Buffer,
    width: int,
    keys: Buffer,
    which: Buffer,
    found: Buffer,
    holder: Buffer,
    seg: int,
    rows: Buffer | None,
) -> int:
    """:func:`._core.match_rows` (the compiled core only)."""
    return _core.match_rows(block, width, keys, which, found, holder, seg, rows)


def find_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`hierps.rows._ids.find_sorted` (where ``keys`` (m,) stand in ``sorted_keys`` (n,)
    ascending: found (m,) bool, at (m,) int64), by the compiled core where it serves and both are
    int64."""
    if not _on or sorted_keys.dtype != np.int64 or keys.dtype != np.int64:
        return _ids.find_sorted(sorted_keys, keys)
    found, at = np.empty(len(keys), bool), np.empty(len(keys), np.int64)
    _core.find_sorted(np.ascontiguousarray(sorted_keys), np.ascontiguousarray(keys), found, at)
    return found, at


def insert_sorted(
    keys: np.ndarray, slots: np.ndarray, new_keys: np.ndarray, new_slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``keys`` (n,) int64 and their ``slots`` (n,) int64 with sorted ``new_keys`` (m,) (none
    among ``keys``) and ``new_slots`` (m,) added in order: (keys (n + m,), slots (n + m,)), new arrays.
    By the compiled core where it serves, else by ``np.insert`` (the same integers)."""
    if not _on:
        at = np.searchsorted(keys, new_keys)
        return np.insert(keys, at, new_keys), np.insert(slots, at, new_slots)
    out_keys, out_slots = (
        np.empty(len(keys) + len(new_keys), np.int64),
        np.empty(len(keys) + len(new_keys), np.int64),
    )
    k, s, nk, ns = (np.ascontiguousarray(a, np.int64) for a in (keys, slots, new_keys, new_slots))
    _core.insert_sorted(k, s, nk, ns, out_keys, out_slots)
    return out_keys, out_slots


def index_add_rows(dst: np.ndarray, rows: np.ndarray, src: np.ndarray) -> None:
    """``dst[rows[i]] += src[i]`` for each entry in order: dst (U, w) float32, rows (n,) int64, src
    (n, w) float32, all contiguous; the floats of ``torch.Tensor.index_add_(0, rows, src)`` on the
    CPU (the compiled core only)."""
    _core.index_add_rows(dst, rows, src, dst.shape[1])


def unique_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids (n,) int64 -> (sorted distinct ids (u,), each id's position among them (n,), their counts
    (u,)): ``np.unique(ids, return_inverse=True, return_counts=True)`` (the compiled core only)."""
    n = len(ids)
    out = np.empty(3 * n, np.int64)
    keys, inverse, counts = out[:n], out[n : 2 * n], out[2 * n :]
    u = _core.unique_ids(ids, keys, inverse, counts)
    return keys[:u], inverse, counts[:u]


def group_ids(
    ids: np.ndarray, keep: np.ndarray, at: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """ids (n,) int64, all among ``keep`` (sorted distinct), ``at`` their positions in it if known ->
    (where: the distinct ids' positions in ``keep`` (u,), their counts (u,), each id's number among
    them (n,), ``np.argsort`` of that, stable (n,)) by counting (the compiled core only)."""
    n = len(ids)
    # local and order are handed back to be kept or joined: each its own array, so that one kept
    # does not keep the scratch of where, counts and positions alive with it. (translate joins them
    # over a mini-batch's tables, in int32 where they fit, and keeps only the joined arrays.)
    local, order = np.empty(n, np.int64), np.empty(n, np.int64)
    out = np.empty(3 * n if at is None else 2 * n, np.int64)
    where, counts = out[:n], out[n : 2 * n]
    pos = out[2 * n :] if at is None else np.ascontiguousarray(at, np.int64)
    u = _core.group_ids(
        np.ascontiguousarray(ids, np.int64), keep, pos, at is None, local, order, where, counts
    )
    return where[:u], counts[:u], local, order

"""Zarr v3 arrays as hierps writes and reads them: one layout, checked before every open.

Every array of a store (segment keys and rows, checkpoint index) is a plain Zarr v3 array with a
regular chunk grid and the codecs ``bytes`` (little endian) + ``crc32c``, every chunk written,
all-zero ones included. Before an array is opened, its ``zarr.json`` must describe exactly that
layout with the expected data type: anything else (a ``numcodecs.pickle`` codec, an object data
type, a Zarr v2 array, a storage transformer) is refused without decoding a byte, since decoding
an unknown codec could run code or return unchecked data. A chunk that is missing would read as
the fill value (zeros), so every chunk must be on disk; a chunk whose crc32c does not match is
reported with its file name.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import zarr
import zarr.codecs
from zarr.storage import LocalStore

from hierps._faults import fault_point
from hierps.errors import CorruptStoreError

__all__ = ["create_array", "encoded_bytes", "open_array", "read_array"]

_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_KEY_ENCODING = {"name": "default", "configuration": {"separator": "/"}}
_META_KEYS = {
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "fill_value",
    "codecs",
    "attributes",
    "storage_transformers",
}
# Rows are written this many chunks at a time (64 MiB with 1 MiB chunks): zarr writes the chunks
# of one call concurrently, and a crash test can stop between two blocks.
_BLOCK_CHUNKS = 64


def encoded_bytes(data: np.ndarray, chunk_rows: int) -> int:
    """Bytes ``data`` takes on disk as written by :func:`create_array` (padded chunks, checksums)."""
    n_chunks = math.ceil(len(data) / chunk_rows) if len(data) else 0
    per_row = data.itemsize * (math.prod(data.shape[1:]) if data.ndim > 1 else 1)
    return n_chunks * (chunk_rows * per_row + 4) + 1024


def create_array(
    zstore: LocalStore, name: str, data: np.ndarray, chunk_rows: int, block_point: str | None = None
) -> None:
    """Write ``data`` (n, ...) as the array ``name``, chunked by ``chunk_rows`` rows."""
    chunk_rows = max(1, chunk_rows)
    arr = zarr.create_array(
        zstore,
        name=name,
        shape=data.shape,
        chunks=(chunk_rows, *data.shape[1:]),
        dtype=data.dtype,
        compressors=[zarr.codecs.Crc32cCodec()],
        fill_value=0,
        config={"write_empty_chunks": True},
    )
    block = chunk_rows * _BLOCK_CHUNKS
    for start in range(0, len(data), block):
        arr[start : start + block] = data[start : start + block]
        if block_point is not None:
            fault_point(block_point)


def _layout_problem(meta: Any, dtype: str, ndim: int) -> str | None:
    """What makes ``meta`` (a parsed zarr.json) differ from the layout hierps writes, or None."""
    if not isinstance(meta, dict):
        return f"expected a JSON object, got {type(meta).__name__}"
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return f"expected a Zarr v3 array, got zarr_format={meta.get('zarr_format')!r} node_type={meta.get('node_type')!r}"
    extra = sorted(set(meta) - _META_KEYS)
    if extra:
        return f"unexpected metadata key(s) {extra}"
    if meta.get("data_type") != dtype:
        return f"data type {meta.get('data_type')!r} where {dtype!r} was expected"
    if meta.get("codecs") != _CODECS:
        return f"codecs {meta.get('codecs')!r} where exactly {_CODECS!r} were expected"
    if meta.get("storage_transformers", []) != []:
        return f"storage transformers {meta.get('storage_transformers')!r}"
    if meta.get("chunk_key_encoding") != _KEY_ENCODING:
        return f"chunk key encoding {meta.get('chunk_key_encoding')!r}"
    shape, grid = meta.get("shape"), meta.get("chunk_grid")
    chunks = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) else None
    if not (
        isinstance(grid, dict)
        and grid.get("name") == "regular"
        and _ints(shape, ndim, 0)
        and _ints(chunks, ndim, 1)
    ):
        return f"shape {shape!r} / chunk grid {grid!r} is not a regular {ndim}-d grid"
    if not isinstance(meta.get("fill_value"), (int, float)) or isinstance(meta.get("fill_value"), bool):
        return f"fill value {meta.get('fill_value')!r}"
    return None


def _ints(value: Any, n: int, low: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == n
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value)
    )


def open_array(zstore: LocalStore, root: Path, name: str, dtype: str, ndim: int) -> zarr.Array:
    """Open array ``name`` read-only after checking its layout and that every chunk is on disk."""
    path = root / name
    try:
        meta = json.loads((path / "zarr.json").read_bytes())
    except FileNotFoundError as exc:
        kind = "a Zarr v2 array, which hierps never writes" if (path / ".zarray").exists() else "missing"
        raise CorruptStoreError(f"{path}: the array is {kind} (no zarr.json); refused.") from exc
    except (OSError, ValueError) as exc:
        raise CorruptStoreError(f"{path / 'zarr.json'}: cannot be read as Zarr metadata ({exc}).") from exc
    problem = _layout_problem(meta, dtype, ndim)
    if problem is not None:
        raise CorruptStoreError(
            f"{path / 'zarr.json'}: not an array hierps wrote ({problem}). hierps opens only {dtype} "
            "arrays with the bytes + crc32c codecs and refuses others without decoding them. Replace "
            "the store with a trusted copy."
        )
    expected = _chunk_keys(meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"])
    present = _files_under(path / "c")
    missing = sorted(expected - present)
    if missing:
        raise CorruptStoreError(
            f"{path / 'c' / missing[0]}: chunk missing ({len(missing)} of {len(expected)} "
            "missing); the array was damaged or deleted while in use."
        )
    try:
        return zarr.open_array(zstore, path=name, mode="r", zarr_format=3)
    except Exception as exc:  # zarr raises many types for damaged metadata; all mean the same here
        raise CorruptStoreError(f"{path}: cannot be opened as a Zarr array ({exc}).") from exc


def _chunk_keys(shape: list[int], chunks: list[int]) -> set[str]:
    grid = [range(math.ceil(s / c)) for s, c in zip(shape, chunks)]
    return {"/".join(map(str, idx)) for idx in itertools.product(*grid)} if all(grid) else set()


def _files_under(root: Path) -> set[str]:
    out = set()
    for dirpath, _dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out.update(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in files)
    return out


def read_array(arr: zarr.Array, root: Path, name: str, positions: np.ndarray | None = None) -> np.ndarray:
    """All of ``arr``, or its rows at sorted ``positions``; ``CorruptStoreError`` naming bad chunks."""
    try:
        return arr[...] if positions is None else arr.oindex[positions.astype(np.int64)]
    except Exception as exc:  # crc mismatch (ValueError), short chunk, vanished file, ...
        bad = _bad_chunks(root / name)
        where = ", ".join(str(p) for p in bad[:3]) if bad else str(root / name)
        raise CorruptStoreError(
            f"{where}: chunk failed its crc32c checksum or could not be read ({exc}). Restore the store "
            "from a backup, or open an earlier checkpoint."
        ) from exc


def _bad_chunks(path: Path) -> list[Path]:
    """Chunk files under ``path/c`` whose trailing crc32c does not match their bytes."""
    bad = []
    for rel in sorted(_files_under(path / "c")):
        try:
            data = (path / "c" / rel).read_bytes()
        except OSError:
            bad.append(path / "c" / rel)
            continue
        if len(data) < 4 or crc32c.crc32c(data[:-4]).to_bytes(4, "little") != data[-4:]:
            bad.append(path / "c" / rel)
    return bad

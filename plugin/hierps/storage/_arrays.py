"""Zarr v3 arrays as hierps writes and reads them: one layout, checked before every open, read and
written with plain file I/O.

Every array of a store (segment keys and rows, checkpoint index) is a Zarr v3 array that
``zarr.open_array`` reads: one shard file ``c/0`` (1-d) or ``c/0/0`` (2-d) holding inner chunks of
``chunk_rows`` full-width rows, each encoded ``bytes`` (little endian) + ``crc32c``, every inner
chunk written (the last one padded with zeros), followed by the shard index (``index_location``
``end``, also ``bytes`` + ``crc32c``). Small inner chunks let a read fetch only the few KiB around
the rows it wants; the shard keeps it one file per array.

A crc32c alone says a chunk is intact, not that it is the chunk asked for: a file copied over
another of the same shape, or two chunks swapped, would pass. So each encoded chunk is followed by
a 4-byte *binding tag*, ``crc32c(chunk number (u64) + the chunk's crc32c (u32))`` started from
``crc32c(identity)``, where the identity names what the array is (the store's id, the array's
place in it: segment or checkpoint, array name). The tag lies between the chunks zarr reads (the
shard index gives each chunk's offset and its ``bytes`` + ``crc32c`` length), so zarr still reads
the array; hierps checks the tag of every chunk it reads. ``zarr.json`` says so in its attributes
(``{"hierps": {"chunk_tag": 4}}``), and arrays without them are refused.

hierps reads and writes these files itself (``os.pread`` / ``os.write``, ``crc32c``,
``np.frombuffer``): zarr's per-call machinery costs more than the I/O for the small, scattered
reads of a pass. Before an array is opened, its ``zarr.json`` must describe exactly one of the two
layouts with the expected data type: anything else (a ``numcodecs.pickle`` codec, an object data
type, a Zarr v2 array, a storage transformer) is refused without decoding a byte, since decoding an
unknown codec could run code or return unchecked data. A chunk that is missing would read as the
fill value (zeros) in zarr, so every chunk must be on disk; a chunk whose crc32c does not match is
reported with its file name. Writing and opening are here; reading is in :mod:`hierps.storage._reads`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import crc32c
import numpy as np
from zarr.storage import LocalStore

from hierps._faults import fault_point
from hierps.errors import CorruptStoreError
from hierps.storage import _native
from hierps.storage._files import OpenFiles

__all__ = [
    "TAG_BYTES",
    "TRAILER",
    "Array",
    "ArrayWriter",
    "binding_tags",
    "create_array",
    "encoded_bytes",
    "encoded_rows_bytes",
    "identity_seed",
    "make_dir",
    "open_array",
]

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
_EMPTY = (1 << 64) - 1  # shard index entry of an inner chunk that was never written
TAG_BYTES = 4  # the binding tag after each encoded chunk
TRAILER = 4 + TAG_BYTES  # bytes after each chunk's rows: its crc32c and its binding tag
_ATTRIBUTES = {"hierps": {"chunk_tag": TAG_BYTES}}
# Inner chunks per write block: a crash test can stop between two blocks.
_BLOCK_CHUNKS = 2048
# A writer hands each this many bytes it wrote to the kernel's writeback at once (not waiting for
# it): the disk writes while the rows after them are made, and the fsync that makes the array
# durable waits for the tail only.
_WRITEBACK_BYTES = 8 << 20


def _sharded_codecs(inner: list[int]) -> list[dict[str, Any]]:
    config = {"chunk_shape": inner, "codecs": _CODECS, "index_codecs": _CODECS, "index_location": "end"}
    return [{"name": "sharding_indexed", "configuration": config}]


@dataclass(frozen=True, eq=False)
class Array:
    """An array hierps wrote, opened for direct reads: where every chunk lies, nothing decoded yet.

    ``files`` holds one file per shard; chunk ``i`` lies in ``files[i // chunks_per_file]`` at
    byte ``offsets[i]``, ``chunk_rows`` rows of ``row_bytes`` each followed by their crc32c and
    their binding tag (seeded with ``seed``, the crc32c of the array's identity). A shard whose
    chunks lie at equal steps (as :class:`ArrayWriter` writes them) keeps only the step,
    ``stride``, and an empty ``offsets``: no RAM per chunk.
    """

    path: Path
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int
    chunks_per_file: int
    files: tuple[Path, ...]
    offsets: np.ndarray  # (n_chunks,) int64, or empty when ``stride`` gives them
    seed: int
    identity: str
    stride: int = 0

    @property
    def n_chunks(self) -> int:
        return math.ceil(self.shape[0] / self.chunk_rows)

    def chunk_offsets(self, chunks: np.ndarray) -> np.ndarray:
        """Byte offsets in their files of ``chunks`` (c,) int64 chunk numbers."""
        if self.stride:
            return np.asarray(chunks, np.int64) * self.stride
        return self.offsets[chunks]

    # Asked for at every read of the array: computed once (a frozen dataclass's cached_property
    # sets the instance's __dict__).
    @functools.cached_property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape[1:])

    @functools.cached_property
    def payload_bytes(self) -> int:
        """Bytes of the rows of one chunk (the last chunk padded)."""
        return self.chunk_rows * self.row_bytes

    @functools.cached_property
    def chunk_bytes(self) -> int:
        """Bytes hierps reads of one chunk: its rows (padded), the crc32c and the binding tag."""
        return self.payload_bytes + TRAILER


def identity_seed(identity: str) -> int:
    """The start of every binding tag of the array named ``identity``."""
    return _native.crc32c(identity.encode("utf-8", "surrogatepass"))


def binding_tags(chunks: np.ndarray, crcs: np.ndarray, seed: int) -> np.ndarray:
    """(c,) chunk numbers and their (c,) crc32c -> (c,) uint32 binding tags of an array of ``seed``."""
    items = np.empty((len(chunks), 12), np.uint8)
    items[:, :8] = np.asarray(chunks, "<u8").view(np.uint8).reshape(-1, 8)
    items[:, 8:] = np.asarray(crcs, "<u4").view(np.uint8).reshape(-1, 4)
    return np.fromiter((crc32c.crc32c(row.data, seed) for row in items), dtype=np.uint32, count=len(items))


def encoded_bytes(data: np.ndarray, chunk_rows: int) -> int:
    """Bytes ``data`` takes on disk as written by :func:`create_array` (padded chunks, checksums)."""
    per_row = data.itemsize * (math.prod(data.shape[1:]) if data.ndim > 1 else 1)
    return encoded_rows_bytes(len(data), per_row, chunk_rows)


def encoded_rows_bytes(rows: int, row_bytes: int, chunk_rows: int) -> int:
    """Bytes an array of ``rows`` rows of ``row_bytes`` each takes on disk (:func:`encoded_bytes`)."""
    n_chunks = math.ceil(rows / chunk_rows) if rows else 0
    return n_chunks * (chunk_rows * row_bytes + TRAILER + 16) + 4 + 1024


# -- writing ---------------------------------------------------------------------------------------
def create_array(
    zstore: LocalStore,
    name: str,
    data: np.ndarray,
    chunk_rows: int,
    block_point: str | None = None,
    *,
    identity: str,
) -> None:
    """Write ``data`` (n, ...) as the array ``name``: one shard of inner chunks of ``chunk_rows`` rows,
    their tags bound to ``identity`` (what the array is; see the module's docstring).

    The chunks in blocks of ``_BLOCK_CHUNKS`` (``block_point`` is a fault point after each), then
    the shard index, then ``zarr.json``. Not durable until the caller fsyncs.
    """
    out = ArrayWriter(
        zstore, name, data.shape[1:], data.dtype.name, chunk_rows, block_point, identity=identity
    )
    out.append(data)
    out.close()


class ArrayWriter:
    """Writes one array of rows of shape ``row_shape`` from runs of rows appended in order.

    Full inner chunks go to the shard file as they fill (in blocks of ``_BLOCK_CHUNKS``, with
    ``block_point`` a fault point after each); :meth:`close` pads the last chunk, writes the shard
    index and then ``zarr.json``, so an array whose writer did not finish has no metadata and
    cannot be opened. Memory: at most one block of chunks. Each chunk's binding tag is bound to
    ``identity``, what the array is (the same string opens it: :func:`open_array`).
    """

    def __init__(
        self,
        zstore: LocalStore,
        name: str,
        row_shape: tuple[int, ...],
        dtype: str,
        chunk_rows: int,
        block_point: str | None = None,
        align: int = 1,
        checksum: bool = False,
        *,
        identity: str,
        dirs_made: bool = False,
    ) -> None:
        self.path = Path(zstore.root) / name
        # Its directories are there already (a tree placed for the writer): no mkdir, each of which
        # would fail, and a stat to check what is there.
        self._dirs_made = dirs_made
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._rest = [int(d) for d in row_shape]
        self._row_bytes = self._dtype.itemsize * math.prod(self._rest)
        self._chunk_rows = max(1, chunk_rows)
        self._payload = self._chunk_rows * self._row_bytes
        # Each encoded chunk starts at a multiple of ``align`` bytes (the shard index says where): a
        # chunk of at most a page then costs one page read, not two.
        self._stride = -(-(self._payload + TRAILER) // align) * align
        self._seed = identity_seed(identity)
        self._identity = identity
        self._block_point = block_point
        self._partial = np.empty((0, self._row_bytes), np.uint8)
        self._fd: int | None = None
        # The encoded chunks' buffer, one block's, used again by each block: a buffer of fresh pages
        # each time costs a page fault a page (in the kernel, about what copying the rows costs).
        self._scratch: np.ndarray | None = None
        self._written = self._handed = 0  # bytes in the shard file; of those, handed to the writeback
        self._chunks = 0
        self._checksum = checksum
        self.n = 0
        self.crc = 0
        """With ``checksum``: crc32c of the bytes of every row appended so far (little endian, no padding)."""
        if not dirs_made:
            make_dir(self.path)

    def append(self, data: np.ndarray) -> None:
        """Rows (k, *row_shape) after those appended so far (each row's values contiguous, the rows
        any step apart: a column slice of a wider array is encoded without a copy of it)."""
        if len(data) == 0:
            return
        rows, at = _byte_rows(data, self._dtype), 0
        if len(self._partial):  # the chunk begun before, completed first
            at = min(self._chunk_rows - len(self._partial), len(rows))
            self._partial = np.concatenate([self._partial, rows[:at]])
            if len(self._partial) == self._chunk_rows:
                self._write_chunks(self._partial)
                self._partial = self._partial[:0]
        full = (len(rows) - at) // self._chunk_rows
        for first in range(0, full, _BLOCK_CHUNKS):
            count = min(_BLOCK_CHUNKS, full - first)
            self._write_chunks(rows[at + first * self._chunk_rows : at + (first + count) * self._chunk_rows])
        if at + full * self._chunk_rows < len(rows):
            self._partial = rows[at + full * self._chunk_rows :].copy()
        self.n += len(data)

    def _write_chunks(self, rows: np.ndarray) -> None:
        """Whole chunks of ``rows`` (k * chunk_rows, row bytes) uint8 to the shard file."""
        if self._fd is None:
            file = shard_file(self.path, 1 + len(self._rest))
            folder = self.path
            for part in [] if self._dirs_made else file.relative_to(self.path).parts[:-1]:
                folder = folder / part  # parent first: each mkdir succeeds at once
                make_dir(folder)
            self._fd = _create(file, self._dirs_made)
        encoded, content = _encode_chunks(
            rows, self._chunk_rows, self._chunks, self._seed, self._stride, self.crc, self._out(len(rows))
        )
        if self._checksum:
            self.crc = content
        try:
            _write_all(self._fd, encoded)
        except BaseException:
            self.abort()  # the array cannot be finished (e.g. a full disk)
            raise
        self._written += encoded.nbytes
        if self._written - self._handed >= _WRITEBACK_BYTES:
            # Dirty pages are written back, not dropped: DONTNEED starts the writeback of the range
            # and drops only its pages that are clean already (none: they were just written).
            with contextlib.suppress(OSError):  # advice only: a file system that refuses it writes alike
                os.posix_fadvise(self._fd, self._handed, self._written - self._handed, os.POSIX_FADV_DONTNEED)
            self._handed = self._written
        self._chunks += len(rows) // self._chunk_rows
        if self._block_point is not None:
            fault_point(self._block_point)

    def _out(self, rows: int) -> np.ndarray:
        """Bytes for the encoded chunks of ``rows`` rows, from the writer's buffer (grown as needed)."""
        need = rows // self._chunk_rows * max(self._stride, self._payload + TRAILER)
        if self._scratch is None or len(self._scratch) < need:
            self._scratch = np.empty(need, np.uint8)
        return self._scratch[:need]

    def abort(self) -> None:
        """Close the shard file without finishing the array. A writer whose write failed is aborted
        by itself; one whose sibling failed is aborted by its owner: a descriptor left open keeps
        the space of the file once it is removed in use, and its file system mounted."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Write the last (padded) chunk, the shard index, then the metadata."""
        try:
            if len(self._partial):
                content = _native.crc32c(self._partial.data, self.crc) if self._checksum else 0
                pad = np.zeros((self._chunk_rows - len(self._partial), self._row_bytes), np.uint8)
                self._write_chunks(np.concatenate([self._partial, pad]))
                self.crc, self._partial = content, self._partial[:0]  # (the padding is not content)
            if self._fd is not None:
                index = np.empty((self._chunks, 2), dtype="<u8")
                index[:, 0] = np.arange(self._chunks, dtype=np.uint64) * np.uint64(self._stride)
                index[:, 1] = self._payload + 4
                _write_all(self._fd, _with_crc(index.view(np.uint8).reshape(1, -1)))
            elif self._dirs_made:  # no chunk: a file left in the tree (its first byte) is emptied
                with contextlib.suppress(FileNotFoundError):
                    os.truncate(shard_file(self.path, 1 + len(self._rest)), 0)
        finally:
            self._scratch = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        meta = {
            "shape": [self.n, *self._rest],
            "data_type": self._dtype.name,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [max(self._chunks, 1) * self._chunk_rows, *self._rest]},
            },
            "chunk_key_encoding": _KEY_ENCODING,
            "fill_value": 0,
            "codecs": _sharded_codecs([self._chunk_rows, *self._rest]),
            "attributes": _ATTRIBUTES,
            "zarr_format": 3,
            "node_type": "array",
            "storage_transformers": [],
        }
        fd = _create(self.path / "zarr.json", self._dirs_made)
        try:
            _write_all(fd, np.frombuffer(json.dumps(meta).encode("utf-8"), np.uint8))
        finally:
            os.close(fd)

    def written(self) -> Array | None:
        """Once closed, the array as :func:`open_array` opens it, without reading it back; None when
        it has no chunk."""
        if self._chunks == 0:
            return None
        file = shard_file(self.path, 1 + len(self._rest))
        return Array(
            self.path,
            (self.n, *self._rest),
            self._dtype,
            self._chunk_rows,
            self._chunks,
            (file,),
            np.empty(0, np.int64),
            self._seed,
            self._identity,
            stride=self._stride,
        )


def shard_file(path: Path, ndim: int, i: int = 0) -> Path:
    """The shard file of an array at ``path`` of ``ndim`` dimensions holding its ``i``-th run of
    chunks along the first (zarr's default chunk key encoding: ``c/i/0/...``)."""
    return path / "c" / "/".join([str(i)] + ["0"] * (ndim - 1))


def _create(file: Path, dirs_made: bool) -> int:
    """``file`` opened to be written anew. Where its directories were said to be made (a tree placed
    for the writer: :class:`hierps.storage._files.Skeletons`), a file there is written over from its
    start, not truncated: the tree's files were cut to their first byte (never to 0 bytes: see
    there), and every file an array writes is longer. A directory missing after all (a tree given
    back by a writer that wrote less) is made then."""
    flags = os.O_WRONLY | os.O_CREAT | (0 if dirs_made else os.O_TRUNC)
    try:
        return os.open(file, flags, 0o644)
    except FileNotFoundError:
        if not dirs_made:
            raise
    make_dir(file.parent)
    return os.open(file, flags, 0o644)


def make_dir(path: Path) -> None:
    """``mkdir -p path`` with one ``mkdir`` per directory made: existing parents are not probed
    (creating a directory costs far more than a failed ``mkdir``, which only a new parent causes)."""
    try:
        os.mkdir(path)
    except FileNotFoundError:
        make_dir(path.parent)
        os.mkdir(path)
    except FileExistsError:
        if not path.is_dir():
            raise


def _with_crc(payloads: np.ndarray) -> np.ndarray:
    """(k, p) uint8 payloads -> (k, p + 4) uint8: each followed by its crc32c (little endian)."""
    out = np.empty((len(payloads), payloads.shape[1] + 4), dtype=np.uint8)
    out[:, :-4] = payloads
    crcs = np.fromiter((_native.crc32c(p) for p in payloads), dtype="<u4", count=len(payloads))
    out[:, -4:] = crcs.view(np.uint8).reshape(-1, 4)
    return out


def _byte_rows(data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """(k, *row_shape) rows as (k, row bytes) uint8 of ``dtype``: a view where each row's values are
    contiguous (the rows any step apart), else a copy."""
    rows = data.reshape(len(data), -1) if data.ndim != 2 else data
    if (
        rows.dtype != dtype
        or rows.strides[1] != rows.itemsize
        or rows.strides[0] < rows.strides[1] * rows.shape[1]
    ):
        rows = np.ascontiguousarray(rows, dtype=dtype)
    return rows.view(np.uint8)


def _encode_chunks(
    rows: np.ndarray,
    chunk_rows: int,
    first: int,
    seed: int,
    stride: int = 0,
    content: int = 0,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """(k * chunk_rows, b) uint8 rows (each contiguous, any step apart) of chunks ``first``.. ->
    ((k, s) uint8 with ``s = max(stride, p + 8)``, ``p = chunk_rows * b``: each chunk's rows followed by
    its crc32c and its binding tag (little endian), then zeros up to ``s`` bytes; the crc32c of the
    rows' bytes continuing ``content``).

    The compiled core encodes in one pass; the numpy code below it is the reference."""
    size = chunk_rows * rows.shape[1]
    width = max(stride, size + TRAILER)
    if _native.enabled():
        shape = (len(rows) // chunk_rows, width)
        out = np.empty(shape, np.uint8) if out is None else out.reshape(shape)
        return out, _native.encode_chunks(rows, chunk_rows, first, seed, width, out, content)
    payloads = np.ascontiguousarray(rows).reshape(-1, size)
    out = np.zeros((len(payloads), width), dtype=np.uint8)
    out[:, : size + 4] = _with_crc(payloads)
    crcs = out[:, size : size + 4].copy().view("<u4").reshape(-1)
    tags = binding_tags(np.arange(first, first + len(payloads)), crcs, seed).astype("<u4")
    out[:, size + 4 : size + TRAILER] = tags.view(np.uint8).reshape(-1, 4)
    return out, _native.crc32c(payloads.data, content)


def _write_all(fd: int, data: np.ndarray) -> None:
    view = memoryview(data.data).cast("B")
    while len(view):
        view = view[os.write(fd, view) :]


# -- opening ---------------------------------------------------------------------------------------
def _layout_problem(meta: Any, dtype: str, ndim: int) -> str | None:
    """What makes ``meta`` (a parsed zarr.json) differ from the layouts hierps writes, or None."""
    if not isinstance(meta, dict):
        return f"expected a JSON object, got {type(meta).__name__}"
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return f"expected a Zarr v3 array, got zarr_format={meta.get('zarr_format')!r} node_type={meta.get('node_type')!r}"
    extra = sorted(set(meta) - _META_KEYS)
    if extra:
        return f"unexpected metadata key(s) {extra}"
    if meta.get("data_type") != dtype:
        return f"data type {meta.get('data_type')!r} where {dtype!r} was expected"
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
        and chunks[1:] == shape[1:]
    ):
        return f"shape {shape!r} / chunk grid {grid!r} is not a regular {ndim}-d grid of full-width chunks"
    codecs = meta.get("codecs")
    inner = _inner_chunk_shape(codecs)
    if not (
        _ints(inner, ndim, 1)
        and codecs == _sharded_codecs(inner)
        and inner[1:] == shape[1:]
        and chunks[0] % inner[0] == 0
    ):
        return (
            f"codecs {codecs!r} where sharding_indexed with exactly {_CODECS!r} inside and full-width "
            "inner chunks dividing the shard were expected"
        )
    if not isinstance(meta.get("fill_value"), (int, float)) or isinstance(meta.get("fill_value"), bool):
        return f"fill value {meta.get('fill_value')!r}"
    if meta.get("attributes") != _ATTRIBUTES:
        return (
            f"attributes {meta.get('attributes')!r} where {_ATTRIBUTES!r} was expected: its chunks carry no "
            "binding tags (an array written by zarr or by an older hierps)"
        )
    return None


def _inner_chunk_shape(codecs: Any) -> Any:
    try:
        return codecs[0]["configuration"]["chunk_shape"]
    except (TypeError, KeyError, IndexError):
        return None


def _ints(value: Any, n: int, low: int) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and len(value) == n
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value)
    )


def open_array(
    zstore: LocalStore,
    root: Path,
    name: str,
    dtype: str,
    ndim: int,
    open_files: OpenFiles | None = None,
    *,
    identity: str,
) -> Array:
    """Open array ``name`` under ``root`` after checking its layout, that every chunk is on disk and
    its shard index (crc32c, every inner chunk present and inside the file). A shard is read through
    ``open_files`` when given (its descriptor then stays open for later reads). Every read of it
    checks that its chunks were written for ``identity`` (the string it was written with) at their
    position."""
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
    shape = tuple(meta["shape"])
    file_rows = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    chunk_rows = _inner_chunk_shape(meta["codecs"])[0]
    n_files = math.ceil(shape[0] / file_rows)
    n_chunks = math.ceil(shape[0] / chunk_rows)
    files = tuple(shard_file(path, ndim, i) for i in range(n_files))
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise CorruptStoreError(
            f"{missing[0]}: chunk missing ({len(missing)} of {n_files} missing); the array was damaged "
            "or deleted while in use."
        )
    arr = Array(
        path,
        shape,
        np.dtype(dtype).newbyteorder("<"),
        chunk_rows,
        file_rows // chunk_rows,
        files,
        np.zeros(n_chunks, np.int64),
        identity_seed(identity),
        identity,
    )
    for i, file in enumerate(files):
        first = i * arr.chunks_per_file
        arr.offsets[first : first + arr.chunks_per_file] = _shard_offsets(
            arr, file, n_chunks - first, open_files
        )
    stride = _regular_stride(arr.offsets) if n_files == 1 else 0
    if stride:
        return dataclasses.replace(arr, offsets=np.empty(0, np.int64), stride=stride)
    return arr


def _regular_stride(offsets: np.ndarray) -> int:
    """The step ``s`` when ``offsets`` are exactly ``0, s, 2s, ...`` (s > 0), else 0."""
    if len(offsets) == 0 or offsets[0] != 0:
        return 0
    step = int(offsets[1]) if len(offsets) > 1 else 1
    if step <= 0 or not np.array_equal(offsets, np.arange(len(offsets), dtype=np.int64) * step):
        return 0
    return step


def _shard_offsets(arr: Array, file: Path, chunks_left: int, open_files: OpenFiles | None) -> np.ndarray:
    """Byte offsets of the inner chunks of shard ``file`` that lie inside the array, from its index."""
    n_index = arr.chunks_per_file
    try:
        fd = open_files.acquire(file) if open_files is not None else os.open(file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            index_at = size - (16 * n_index + 4)
            raw = os.pread(fd, 16 * n_index + 4, max(index_at, 0))
        finally:
            open_files.release(fd) if open_files is not None else os.close(fd)
    except OSError as exc:
        raise CorruptStoreError(f"{file}: the shard could not be read ({exc}).") from exc
    if index_at < 0 or _native.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise CorruptStoreError(
            f"{file}: the shard index failed its crc32c checksum (or the file is truncated: {size} bytes). "
            "Restore the store from a backup, or open an earlier checkpoint."
        )
    index = np.frombuffer(raw[:-4], dtype="<u8").reshape(n_index, 2)[: min(n_index, chunks_left)]
    if np.any(index[:, 0] == _EMPTY):
        raise CorruptStoreError(
            f"{file}: chunk missing (inner chunk {int(np.flatnonzero(index[:, 0] == _EMPTY)[0])} was never "
            "written); the array was damaged."
        )
    if np.any(index[:, 1] != arr.payload_bytes + 4) or np.any(index[:, 0] > index_at - arr.chunk_bytes):
        raise CorruptStoreError(
            f"{file}: the shard index points outside the file or at chunks of the wrong size "
            f"(expected {arr.payload_bytes + 4} bytes each, followed by a binding tag); the shard is damaged."
        )
    return index[:, 0].astype(np.int64)

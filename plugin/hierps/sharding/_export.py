"""The export of a sharded store from its job: one rank writes it, the others stream their parts to it.

A sharded store's parts may lie on each host's own disk (node-local storage), so no one process
reads them all. :func:`export_sharded` (:meth:`hierps.ShardedStore.export`, collective) writes one
export, in the format :mod:`hierps.serving` reads (:mod:`hierps.lifecycle._export`), into one
directory on the host of the *writer* rank (rank 0 by default):

- every rank learns which parts of the checkpoint (and of the ``since`` checkpoint, for a delta) its
  host's disk holds; each part is read by one rank that sees it (rank q for part q where it can, as
  a reshard reads them), and a part no rank sees raises :class:`~hierps.errors.MissingPartsError`
  on every rank, before anything is written;
- the writer merges the parts by key, table by table, as one process merges the rank stores of a
  shared directory (:func:`~hierps.lifecycle._export.write_export`): the parts its own host holds it
  reads itself; for the others it asks their reader for the next piece whenever the merge needs
  one. A delta is computed where the part lies (the two checkpoints of a part are on one disk), so
  only changed rows travel;
- the export is written under a temporary name and renamed into place once every rank has said its
  parts were read without error: a failure anywhere leaves no export, and raises on every rank.

What it costs: every exported row crosses the network once (8 bytes of key and 4 bytes per weight;
a delta: the changed rows and the deleted keys), in pieces of at most :data:`PIECE_ROWS` rows, each
piece one small all-reduce (the writer's request) and two all-to-alls, so the writer's memory is one
piece per part plus the merge's buffers, whatever the tables' size. The ranks not asked wait in
those collectives, so the job does nothing else meanwhile. The export lands on one host; to serve
elsewhere, pass ``rank=`` a rank of the serving host, or copy the directory (``rsync``, ``scp``,
an object store): it is self-contained and checked by its checksums when served.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hierps.errors import ConfigError, HierpsError
from hierps.lifecycle._export import (
    ExportPart,
    LocalPart,
    Rows,
    check_dtype,
    check_export_path,
    check_since,
    export_manifest,
    write_export,
)
from hierps.rows._table import TableInfo
from hierps.sharding._commits import (
    Collectives,
    Snapshot,
    _gather_bytes,
    _gather_ints,
    _missing,
    _reaches,
    _readers,
)
from hierps.storage._commit_log import find_in, rank_dir
from hierps.storage._manifest import Manifest
from hierps.tiers._reader import CheckpointReader

__all__ = ["PIECE_ROWS", "export_sharded"]

PIECE_ROWS = 1 << 16  # rows of one part sent to the writer at a time

# The writer's requests (op, part, table, n): an all-reduce, the writer's values (others send zeros).
_END_OK, _PIECE, _GONE, _HOLDS, _END_FAILED = 1, 2, 3, 4, 5
# The first value of an answer: rows follow, the part's rows are all sent, the reader failed.
_DATA, _DONE, _FAILED = 1, 0, -1


def export_sharded(
    root: Path,
    coll: Collectives,
    catalog: list[Snapshot],
    out: str | os.PathLike[str],
    *,
    since: int | str | None,
    checkpoint: int | str | None,
    dtype: str,
    writer: int,
) -> dict[str, Any]:
    """Export checkpoint ``checkpoint`` (None: the latest) of the sharded ``root`` (since ``since``:
    a delta) to ``out`` on rank ``writer``'s host, in ``dtype``; every rank returns its manifest
    (collective; see the module docstring)."""
    check_dtype(dtype)
    if not 0 <= writer < coll.world_size:
        raise ConfigError(
            f"rank: expected a rank of this job, from the inclusive range (0, {coll.world_size - 1}). "
            f"Got {writer} instead."
        )
    snap = _find(root, catalog, checkpoint, "checkpoint")
    base = _find(root, catalog, since, "since") if since is not None else None
    if base is not None:
        check_since(
            since if since is not None else base.id, base.id, snap.id, base.world_size, snap.world_size
        )
    reach = [
        int(_reaches(root, snap, q) and (base is None or _reaches(root, base, q)))
        for q in range(snap.world_size)
    ]
    seen = _gather_ints(coll, reach)
    error = _missing(root, snap, seen, own_parts=False, action="exported")
    if error is not None:
        raise error
    # The writer reads what its host holds (all of it on a shared file system); others stream the rest.
    readers = [writer if seen[writer][q] else r for q, r in enumerate(_readers(snap, seen))]
    mine: dict[int, LocalPart] = {}
    try:
        failure: BaseException | None = None
        try:
            for q in (q for q, reader in enumerate(readers) if reader == coll.rank):
                old = CheckpointReader(rank_dir(root, q), base.parts[q]) if base is not None else None
                mine[q] = LocalPart(CheckpointReader(rank_dir(root, q), snap.parts[q]), old)
        except HierpsError as exc:  # raised below, once every rank knows
            failure = exc
        link = _Link(coll, writer, readers, _described(coll, mine, failure, out), dtype)
        if coll.rank != writer:
            return link.serve(mine, out)
        parts: list[ExportPart] = [mine.get(q) or _RemotePart(link, q) for q in range(snap.world_size)]
        created = link.since_created if base is not None else None
        manifest = export_manifest(root, snap.id, base.id if base else None, parts, snap.stores[0], created)
        return link.write(root, out, manifest, parts, dtype)
    finally:
        for part in mine.values():
            part.close()


def _find(root: Path, catalog: list[Snapshot], ref: int | str | None, what: str) -> Snapshot:
    snap = find_in(catalog, ref)
    if snap is None:
        raise ConfigError(
            f"{root}: no {what} {'at all' if ref is None else repr(ref)} committed for all ranks (it has "
            f"{[(s.id, s.tag) for s in catalog]}, as (id, tag)); a retired checkpoint cannot be exported "
            "from. Checkpoint the store first, export in full, or raise keep_checkpoints."
        )
    return snap


@dataclass(frozen=True)
class _Described:
    """What the writer knows of a part another rank reads: its checkpoint's manifest and tables."""

    path: Path
    meta: Manifest
    infos: dict[str, TableInfo]
    since_created: float | None


def _described(
    coll: Collectives, mine: dict[int, LocalPart], failure: BaseException | None, out: str | os.PathLike[str]
) -> dict[int, _Described]:
    """Every part's manifest, as its reader holds it (collective); raises on every rank when a rank
    could not open its parts (``failure``)."""
    error = None if failure is None else f"{type(failure).__name__}: {failure}"
    blob = json.dumps(
        {
            "error": error,
            "parts": {
                str(q): {
                    "path": str(p.path),
                    "manifest": p.meta.to_json(),
                    "since_created": p.old.meta.created if p.old is not None else None,
                }
                for q, p in mine.items()
            },
        }
    ).encode()
    got = [json.loads(b) for b in _gather_bytes(coll, blob)]
    if failure is not None:
        raise failure
    failed = [f"rank {r}: {g['error']}" for r, g in enumerate(got) if g["error"]]
    if failed:
        raise HierpsError(f"{out}: the export failed, so none was written; " + "; ".join(failed))
    described = {}
    for g in got:
        for q, body in g["parts"].items():
            path = Path(body["path"])
            meta = Manifest.from_json(path, int(body["manifest"]["id"]), body["manifest"])
            infos = {name: entry.table_info(name, meta.seed) for name, entry in meta.tables.items()}
            described[int(q)] = _Described(path, meta, infos, body["since_created"])
    return described


class _Link:
    """The writer's requests to the ranks that read the parts, and their answers (each a collective:
    every rank takes part in every exchange, the ranks not concerned with nothing to send)."""

    def __init__(
        self,
        coll: Collectives,
        writer: int,
        readers: list[int],
        described: dict[int, _Described],
        dtype: str,
    ) -> None:
        self.coll, self.writer, self.readers, self.described = coll, writer, readers, described
        self.dtype = dtype  # readers round to it (a delta compares weights as served)
        self.rank = coll.rank
        names = sorted({name for d in described.values() for name in d.infos})
        self.tables = {name: i for i, name in enumerate(names)}
        self.names = names
        self.dims = [next(d.infos[n].dim for d in described.values() if n in d.infos) for n in names]
        self.since_created = described[0].since_created if 0 in described else None

    # -- the exchanges -------------------------------------------------------------------------
    def _request(self, op: int = 0, part: int = 0, table: int = 0, n: int = 0) -> list[int]:
        mine = torch.tensor([op, part, table, n] if self.rank == self.writer else [0, 0, 0, 0])
        return [int(v) for v in self.coll.all_reduce_sum(mine.to(torch.int64)).tolist()]

    def _send(self, dest: int, data: torch.Tensor | None, empty: torch.Tensor) -> torch.Tensor:
        """``data`` from this rank to rank ``dest`` (None: nothing; every rank passes ``empty``, of
        the payload's dtype and row shape) -> what this rank received."""
        counts = [0] * self.coll.world_size
        if data is not None:
            counts[dest] = int(data.shape[0])
        got, _ = self.coll.all_to_all(data if data is not None else empty, counts)
        return got

    def _answer(self, part: int, head: torch.Tensor | None) -> torch.Tensor:
        """The reader of ``part`` sends ``head`` ((n,) int64: a status, then its values) to the writer."""
        return self._send(self.writer, head if self.rank == self.readers[part] else None, _NO_INTS)

    # -- the writer's side ---------------------------------------------------------------------
    def piece(self, part: int, table: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The next piece of ``part``'s rows of ``table`` from its reader, or None after the last."""
        self._request(_PIECE, part, self.tables[table])
        head = self._answer(part, None)
        rows = self._send(self.writer, None, torch.empty((0, self.dims[self.tables[table]])))
        self._check(head, part, f"its rows of table {table!r}")
        if int(head[0]) == _DONE:
            return None
        return head[1:].numpy(), rows.numpy()

    def gone(self, part: int, table: str) -> np.ndarray:
        self._request(_GONE, part, self.tables[table])
        head = self._answer(part, None)
        self._check(head, part, f"its deleted keys of table {table!r}")
        return head[1:].numpy()

    def holds(self, part: int, table: str, keys: np.ndarray) -> np.ndarray:
        self._request(_HOLDS, part, self.tables[table], len(keys))
        self._send(self.readers[part], torch.from_numpy(np.ascontiguousarray(keys)), _NO_INTS)
        head = self._answer(part, None)
        self._check(head, part, f"which deleted keys of table {table!r} it holds")
        return head[1:].numpy().astype(bool)

    def _check(self, head: torch.Tensor, part: int, what: str) -> None:
        if int(head[0]) == _FAILED:
            message = bytes(head[1:].to(torch.uint8).tolist()).decode(errors="replace")
            raise HierpsError(
                f"rank {self.readers[part]}, reading part {part}, failed to send {what}: {message}"
            )

    def write(
        self,
        root: Path,
        out: str | os.PathLike[str],
        manifest: dict[str, Any],
        parts: list[ExportPart],
        dtype: str,
    ) -> dict[str, Any]:
        """Write the export (the writer; collective with :meth:`serve`)."""
        stage = "reading"

        def ready(done: dict[str, Any]) -> None:
            nonlocal stage
            stage = "agreeing"
            self._request(_END_OK)
            self._outcome(out, None, done)
            stage = "placing"

        try:
            target = check_export_path(root, out)
            write_export(target, manifest, parts, dtype, ready)
        except BaseException as exc:
            if stage == "reading":
                self._request(_END_FAILED)
                self._outcome(out, exc, None)
            elif stage == "placing":
                _gather_ints(self.coll, [0])
            raise
        _gather_ints(self.coll, [1])
        return manifest

    def _outcome(
        self, out: str | os.PathLike[str], failure: BaseException | None, manifest: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Every rank's error (or none) and the writer's manifest, to every rank (collective); raises
        this rank's own failure, or one naming the ranks that failed."""
        blob = json.dumps(
            {
                "error": None if failure is None else f"{type(failure).__name__}: {failure}",
                "manifest": manifest,
            }
        ).encode()
        got = [json.loads(b) for b in _gather_bytes(self.coll, blob)]
        if failure is not None:
            raise failure
        failed = [f"rank {r}: {g['error']}" for r, g in enumerate(got) if g["error"]]
        if failed:
            raise HierpsError(f"{out}: the export failed, so none was written; " + "; ".join(failed))
        return dict(got[self.writer]["manifest"])

    # -- the other ranks' side -----------------------------------------------------------------
    def serve(self, mine: dict[int, LocalPart], out: str | os.PathLike[str]) -> dict[str, Any]:
        """Answer the writer's requests for the parts this rank reads until it ends the export;
        returns its manifest (collective with :meth:`write`)."""
        failure: BaseException | None = None
        sources: dict[tuple[int, int], Rows] = {}
        while True:
            op, part, table, n = self._request()
            if op in (_END_OK, _END_FAILED):
                break
            name, asked = self.names[table], self.readers[part] == self.rank
            head: torch.Tensor | None = None
            if op == _PIECE:
                rows = None
                if asked:
                    try:
                        source = sources.setdefault(
                            (part, table), mine[part].rows(name, self.dims[table], self.dtype)
                        )
                        head, rows = _next_piece(source, self.dims[table])
                    except Exception as exc:  # told to the writer, which ends the export
                        failure, head = exc, _failed(exc)
                self._answer(part, head)
                self._send(
                    self.writer,
                    rows if head is not None and int(head[0]) == _DATA else None,
                    torch.empty((0, self.dims[table])),
                )
            elif op == _GONE:
                if asked:
                    try:
                        head = _ints(_DATA, mine[part].gone(name))
                    except Exception as exc:
                        failure, head = exc, _failed(exc)
                self._answer(part, head)
            elif op == _HOLDS:
                keys = self._send(self.readers[part], None, _NO_INTS)
                if asked:
                    try:
                        head = _ints(_DATA, mine[part].holds(name, keys.numpy()).astype(np.int64))
                    except Exception as exc:
                        failure, head = exc, _failed(exc)
                self._answer(part, head)
        manifest = self._outcome(out, failure, None)
        if not _gather_ints(self.coll, [0])[self.writer][0]:
            raise HierpsError(
                f"{out}: rank {self.writer} wrote the export but could not put it in place; see its error."
            )
        return manifest


_NO_INTS = torch.empty(0, dtype=torch.int64)


def _ints(status: int, values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([np.array([status], np.int64), values.astype(np.int64)]))


def _failed(exc: BaseException) -> torch.Tensor:
    text = f"{type(exc).__name__}: {exc}".encode()
    return _ints(_FAILED, np.frombuffer(text, np.uint8))


def _next_piece(source: Rows, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to about :data:`PIECE_ROWS` rows of ``source`` (its next batches, in key order) -> (status
    and keys (1 + n,) int64, weights (n, dim) float32); status ``_DONE`` once it has no more."""
    keys, rows, n = [], [], 0
    while n < PIECE_ROWS:
        batch = next(source, None)
        if batch is None:
            break
        keys.append(batch[0])
        rows.append(batch[1])
        n += len(batch[0])
    if not keys:
        return _ints(_DONE, np.empty(0, np.int64)), torch.empty((0, dim))
    return _ints(_DATA, np.concatenate(keys)), torch.from_numpy(np.ascontiguousarray(np.concatenate(rows)))


class _RemotePart:
    """The :class:`~hierps.lifecycle._export.ExportPart` of part ``part``, read by another rank and
    sent to the writer piece by piece."""

    def __init__(self, link: _Link, part: int) -> None:
        self._link, self._part = link, part
        d = link.described[part]
        self.path, self.meta, self.infos = d.path, d.meta, d.infos

    def rows(self, table: str, dim: int, dtype: str) -> Rows:
        # (rounded to dtype by the reader: the link's dtype is the export's)
        while (piece := self._link.piece(self._part, table)) is not None:
            yield piece

    def gone(self, table: str) -> np.ndarray:
        return self._link.gone(self._part, table)

    def holds(self, table: str, keys: np.ndarray) -> np.ndarray:
        return self._link.holds(self._part, table, keys)

"""A checkpoint's manifest, typed: what a checkpoint of one store holds, checked once when read.

``<store>/checkpoints/00000007.json``::

    {"id": 7, "format_version": 4, "tag": "day-3" | null, "created": 1733100000.0,
     "seed": 0, "passes": 12, "next_segment": 40, "keep_checkpoints": 3,
     "extra": {...the caller's JSON object, e.g. the world size of a sharded run...},
     "tables": {"user": {<the table's settings: TableInfo.to_json()>,
                         "rows": 1000, "pending": 3,
                         "segments": {"12": 800, "31": 400},   # segment id -> rows
                         "live": {"12": 700, "31": 300},       # segment id -> live rows
                         "check": {"12": 9134, "31": 77},     # segment id -> fences check
                         "origin": {"31": "<uid>:segments/user/00000009"}}}}
                         # (only for segments adopted from another store: what their chunks' tags name)

:class:`Manifest` and :class:`TableEntry` are that file's only readers and writers: ``from_json``
checks every field (``CorruptStoreError`` naming the file and the field, ``StoreFormatError`` for
another format version), ``to_json`` is its inverse, and :meth:`Manifest.check` tells a writer,
before anything is written, whether a reader would accept what it is about to commit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from hierps.config import InitializerConfig, OptimizerConfig
from hierps.errors import ConfigError, CorruptStoreError
from hierps.rows._table import TableInfo
from hierps.storage._format import FORMAT_VERSION, MAX_DIM, require_format_version
from hierps.storage._names import table_name_problem

__all__ = ["Manifest", "SegmentRef", "TableEntry"]

# What an adopted segment's chunks are bound to: the store that wrote it, and its name there.
_ORIGIN = re.compile(r"[^:/]+:segments/[^/]+/[0-9]{8,}")

# The table settings a manifest entry carries (TableInfo.to_json()), beside its rows and segments.
_COUNTS = (("dim", 1), ("width", 1), ("step", 0), ("rows", 0), ("pending", 0))


class SegmentRef(NamedTuple):
    """One segment a checkpoint names for a table: its rows, how many are live, its content check,
    and for a segment adopted from another store (a reshard that links an old part's segments in),
    what its chunks' binding tags name: ``"<store id>:segments/<table>/<segment>"`` of the store that
    wrote it (None: this store, under its own name)."""

    rows: int
    live: int
    check: int
    origin: str | None = None


@dataclass(frozen=True)
class TableEntry:
    """One table of a checkpoint: its settings (as :meth:`TableInfo.to_json` writes them; typed:
    :meth:`table_info`), its row count, its keys pending admission, the segments of its live set."""

    settings: Mapping[str, Any]
    rows: int
    pending: int
    segments: Mapping[int, SegmentRef]

    @classmethod
    def of(cls, info: TableInfo, pending: int, segments: Mapping[int, SegmentRef]) -> TableEntry:
        """The entry of table ``info`` now: ``segments`` its live set, ``pending`` its waiting keys."""
        return cls(info.to_json(), sum(s.live for s in segments.values()), pending, dict(segments))

    def table_info(self, name: str, seed: int) -> TableInfo:
        """A fresh :class:`TableInfo` of the table (``StoreFormatError`` when its recorded row
        layout is not the one its optimizer and precisions give)."""
        return TableInfo.from_json(name, dict(self.settings), seed)

    def to_json(self) -> dict[str, Any]:
        segs = sorted(self.segments.items())
        return {
            **self.settings,
            "rows": self.rows,
            "pending": self.pending,
            "segments": {str(s): ref.rows for s, ref in segs},
            "live": {str(s): ref.live for s, ref in segs},
            "check": {str(s): ref.check for s, ref in segs},
            **(
                {"origin": {str(s): ref.origin for s, ref in segs if ref.origin is not None}}
                if any(ref.origin is not None for _, ref in segs)
                else {}
            ),
        }

    @classmethod
    def from_json(cls, path: Path, name: str, meta: Any) -> TableEntry:
        """The checked entry of table ``name`` in the manifest file ``path``."""
        where = f"tables.{name}"
        if not isinstance(meta, dict):
            raise _bad(path, where, "an object", meta)
        for key, low in _COUNTS:
            if not _is_int(meta.get(key)) or meta[key] < low:
                raise _bad(path, f"{where}.{key}", f"an int >= {low}", meta.get(key))
        if meta["dim"] > MAX_DIM:
            raise _bad(path, f"{where}.dim", f"an int <= {MAX_DIM}", meta["dim"])
        segments, live, check = meta.get("segments"), meta.get("live"), meta.get("check")
        if not isinstance(segments, dict) or not all(
            isinstance(s, str) and s.isdigit() and _is_int(n) and n >= 0 for s, n in segments.items()
        ):
            raise _bad(path, f"{where}.segments", "an object of segment id -> row count", segments)
        if (
            not isinstance(live, dict)
            or set(live) != set(segments)
            or not all(_is_int(n) and 0 <= n <= segments[s] for s, n in live.items())
        ):
            raise _bad(
                path, f"{where}.live", "an object of segment id -> live rows, for the same segments", live
            )
        if (
            not isinstance(check, dict)
            or set(check) != set(segments)
            or not all(_is_int(c) for c in check.values())
        ):
            raise _bad(
                path,
                f"{where}.check",
                "an object of segment id -> content check, for the same segments",
                check,
            )
        origin = meta.get("origin", {})
        if (
            not isinstance(origin, dict)
            or not set(origin) <= set(segments)
            or not all(isinstance(o, str) and _ORIGIN.fullmatch(o) for o in origin.values())
        ):
            raise _bad(
                path,
                f"{where}.origin",
                "an object of segment id -> '<store id>:segments/<table>/<segment>', for some of its segments",
                origin,
            )
        if sum(live.values()) != meta["rows"]:
            raise _bad(
                path,
                f"{where}.rows",
                f"the sum of its segments' live rows ({sum(live.values())})",
                meta["rows"],
            )
        try:
            OptimizerConfig.parse(meta.get("optimizer"))
            InitializerConfig.parse(meta.get("initializer"))
        except ConfigError as exc:
            raise CorruptStoreError(f"{path}: table {name!r}: {exc}") from exc
        settings = {
            k: v
            for k, v in meta.items()
            if k not in ("rows", "pending", "segments", "live", "check", "origin")
        }
        refs = {int(s): SegmentRef(n, live[s], check[s], origin.get(s)) for s, n in segments.items()}
        return cls(settings, meta["rows"], meta["pending"], refs)


@dataclass(frozen=True)
class Manifest:
    """A checkpoint of one store: its id and tag, the store's counters, and every table's entry.

    ``extra`` is the caller's JSON object, kept as given (:meth:`hierps.Store.checkpoint`'s
    ``extra``; a sharded store records its world size and rank there).
    """

    id: int
    tag: str | None
    created: float
    seed: int
    passes: int
    next_segment: int
    keep_checkpoints: int
    tables: Mapping[str, TableEntry]
    extra: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def world_size(self) -> int:
        """Ranks of the sharded checkpoint this is a part of (1: a checkpoint of one process)."""
        return int(self.extra.get("world_size", 1))

    def to_json(self) -> dict[str, Any]:
        """The manifest file's object: each field under its own name (the file's keys)."""
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["extra"] = dict(self.extra)
        body["tables"] = {name: entry.to_json() for name, entry in self.tables.items()}
        return body

    @classmethod
    def from_json(cls, path: Path, ckpt: int, body: Any) -> Manifest:
        """The checked manifest of checkpoint ``ckpt`` read from ``path``: ``StoreFormatError`` for
        another format version, ``CorruptStoreError`` naming the field that does not verify."""
        if not isinstance(body, dict):
            raise _bad(path, "(document)", "an object", type(body).__name__)
        require_format_version(path, f"checkpoint {ckpt}", body.get("format_version"))
        if not _is_int(body.get("id")) or body["id"] != ckpt:
            raise _bad(path, "id", f"the checkpoint id {ckpt} of the file name", body.get("id"))
        tag, extra, created = body.get("tag"), body.get("extra", {}), body.get("created", 0.0)
        if tag is not None and not isinstance(tag, str):
            raise _bad(path, "tag", "a string or null", tag)
        if not isinstance(extra, dict):
            raise _bad(path, "extra", "an object", extra)
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise _bad(path, "created", "a time in seconds", created)
        for key, low in (("seed", None), ("passes", 0), ("next_segment", 1)):
            if not _is_int(body.get(key)) or (low is not None and body[key] < low):
                raise _bad(path, key, "an int" if low is None else f"an int >= {low}", body.get(key))
        tables = body.get("tables")
        if not isinstance(tables, dict):
            raise _bad(path, "tables", "an object of tables", tables)
        if not _is_int(body.get("keep_checkpoints")) or body["keep_checkpoints"] < 1:
            raise _bad(path, "keep_checkpoints", "an int >= 1", body.get("keep_checkpoints"))
        for name in tables:
            problem = table_name_problem(name)
            if problem is not None:
                raise CorruptStoreError(
                    f"{path}: table name {name!r} is not a valid table name: expected {problem}."
                )
        return cls(
            id=ckpt,
            tag=tag,
            created=float(created),
            seed=body["seed"],
            passes=body["passes"],
            next_segment=body["next_segment"],
            keep_checkpoints=body["keep_checkpoints"],
            tables={name: TableEntry.from_json(path, name, meta) for name, meta in tables.items()},
            extra=extra,
        )

    def check(self, path: Path) -> None:
        """``ConfigError`` unless a reader would accept this manifest once written to ``path``
        (values JSON cannot hold, a tag that is no str, ...): checked before anything is written."""
        try:
            Manifest.from_json(path, self.id, json.loads(json.dumps(self.to_json(), sort_keys=True)))
        except (CorruptStoreError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"checkpoint {self.id} would not be readable, so it was not written: {exc}"
            ) from exc


def _bad(path: Path, where: str, expected: str, value: Any) -> CorruptStoreError:
    return CorruptStoreError(
        f"{path}: field {where}: expected {expected}. Got {value!r} instead. "
        "The manifest is damaged or was not written by hierps."
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""Served tables: the exports of one chain, read on demand, with a row cache, following new deltas.

The state a lookup reads is one immutable :class:`_Generation` (the chain of exports and its tables),
replaced by a single assignment when :meth:`ServingTables.refresh` has opened and checked a new
chain in full: a lookup takes the generation once and reads only it, so it sees every row of one
generation and none of another. The caches follow the rule of :mod:`hierps.serving._cache`.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hierps.config import UNADMITTED_VALUES, parse_size
from hierps.errors import ConfigError, HierpsError, StoreClosedError
from hierps.rows import _ids
from hierps.serving._cache import RowCache
from hierps.serving._chain import check_chain, explicit_chain, find_chain, is_export
from hierps.serving._layers import ServedTable, served_tables
from hierps.storage._export_format import ExportManifest, read_manifest
from hierps.storage._export_tables import ExportTable
from hierps.storage._files import OpenFiles

__all__ = ["DEFAULT_CACHE_BYTES", "VERIFY", "ServingTables", "open"]

log = logging.getLogger("hierps.serving")

DEFAULT_CACHE_BYTES = 64 << 20
# Ids read from disk at a time: each costs a few chunks read and decoded (about 10 KiB at dim 16),
# so a lookup of many ids holds about this many ids' worth, however many it asks for.
READ_BATCH = 4096
VERIFY = ("none", "deltas", "all")


@dataclass(frozen=True, eq=False)
class _Generation:
    """The exports served, base first, and their tables: what one lookup reads."""

    number: int
    chain: tuple[ExportManifest, ...]
    tables: dict[str, ServedTable]


class ServingTables:
    """Embedding tables as of one checkpoint, read-only, read from disk on demand: see :func:`open`."""

    def __init__(
        self,
        chain: list[ExportManifest],
        directory: Path | None,
        unknown: str | None,
        cache_bytes: int,
        verify: str,
    ) -> None:
        self._directory = directory
        self._unknown = unknown
        self._cache_bytes = cache_bytes
        self._verify = verify
        self._files = OpenFiles()
        self._opened: dict[Path, dict[str, ExportTable]] = {}
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._follower: threading.Thread | None = None
        self._polled = threading.Condition()  # notified as each poll of the follower ends
        self._polls_started = self._polls_done = 0
        self._reported: str | None = None  # the last refresh error logged by the follower
        self._closed = False
        self.refresh_error: BaseException | None = None
        """What the last refresh by ``follow`` raised (None once one succeeds): the previous generation
        kept serving. A delta that is damaged, of another store, or after a missing one, for example."""
        try:
            self._opened.update(self._open_new(chain, first=True))
            self._generation = _Generation(1, tuple(chain), served_tables(chain, self._opened, unknown))
        except BaseException:
            self._files.close()
            raise
        self._caches = self._make_caches(self._generation)

    # -- what is served ------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """Counts the chains served: 1 at open, one more for each refresh that changed it."""
        return self._generation.number

    @property
    def checkpoint(self) -> int:
        """The checkpoint the rows are as of."""
        return self._generation.chain[-1].checkpoint

    @property
    def applied(self) -> list[Path]:
        """The exports applied, base first."""
        return [m.path for m in self._generation.chain]

    @property
    def tables(self) -> dict[str, int]:
        """Table name -> dim."""
        return {name: t.dim for name, t in self._generation.tables.items()}

    def num_rows(self, table: str) -> int:
        return self._table(self._generation, table).rows

    def keys(self, table: str) -> np.ndarray:
        """(n,) int64 sorted keys that have a row. Reads every key of the table: O(n) memory."""
        return self._table(self._generation, table).keys()

    @property
    def index_bytes(self) -> int:
        """Bytes of RAM held to find keys (fences and filters of every table of every export)."""
        return sum(t.ram_bytes for t in self._generation.tables.values())

    def cache_info(self) -> dict[str, int]:
        """Rows found in the cache and read from disk since open, the cache's capacity in rows and bytes."""
        caches = list(self._caches.values())
        return {
            "hits": sum(c.hits for c in caches),
            "misses": sum(c.misses for c in caches),
            "capacity_rows": sum(c.capacity for c in caches),
            "bytes": sum(c.nbytes for c in caches),
        }

    def lookup(self, table: str, ids: Any) -> np.ndarray | torch.Tensor:
        """ids: (...) int64 (tensor, array or list) -> (..., dim) float32 rows.

        A torch tensor of ids gives a torch tensor on the same device; anything else a numpy array.
        Rows come from the cache or from disk (each chunk read checked); all of one generation.
        """
        self._check_open()
        gen = self._generation
        t = self._table(gen, table)
        flat = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
        shape = tuple(ids.shape) if hasattr(ids, "shape") else (len(flat),)
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = np.empty((len(unique), t.dim), np.float32)
        cache = self._caches.get(table)
        hit = np.zeros(len(unique), bool)
        if cache is not None:
            hit, cached = cache.get(unique, gen.number)
            rows[hit] = cached
        at = np.flatnonzero(~hit)
        for start in range(0, len(at), READ_BATCH):
            part = at[start : start + READ_BATCH]
            rows[part] = read = t.read(unique[part], self._files)
            if cache is not None:
                cache.put(unique[part], read, gen.number)
        out = rows[inverse].reshape(*shape, t.dim)
        if isinstance(ids, torch.Tensor):
            return torch.from_numpy(out).to(ids.device)
        return out

    def _table(self, gen: _Generation, table: str) -> ServedTable:
        try:
            return gen.tables[table]
        except KeyError:
            raise ConfigError(f"unknown table {table!r}; the exports hold {sorted(gen.tables)}.") from None

    # -- following new exports -----------------------------------------------------------------
    def refresh(self, deltas: list[str | os.PathLike[str]] | None = None) -> bool:
        """Serve what was exported since: in a serving directory, its chain as it is now (new deltas,
        or a new base); otherwise ``deltas``, exports each taken since the previous one's checkpoint,
        applied after those served. Returns whether anything changed.

        The new chain is opened and checked whole first (every new delta read and compared with
        its checksums unless ``verify="none"``); only then is it served, all at once. If anything
        in it is damaged or incomplete, this raises (a ``hierps.errors`` exception naming the file)
        and the previous generation keeps serving, unchanged.
        """
        with self._refresh_lock:
            self._check_open()
            old = self._generation
            chain = self._next_chain(old, None if deltas is None else _paths(deltas, "deltas"))
            if _same(chain, old.chain):
                return False
            kept = _common_prefix(chain, old.chain)
            opened = {**self._opened, **self._open_new(chain[kept:], first=kept == 0)}
            tables = served_tables(chain, opened, self._unknown)
            self._opened = opened
            gen = _Generation(old.number + 1, tuple(chain), tables)
            incremental = kept == len(old.chain) and set(tables) == set(old.tables)
            self._install(gen, chain[kept:] if incremental else None)
            self._forget(old.chain, chain)
            return True

    def _next_chain(self, old: _Generation, deltas: list[Path] | None) -> list[ExportManifest]:
        if self._directory is not None:
            if deltas is not None:
                raise ConfigError(
                    f"{self._directory}: a serving directory finds its own deltas; call refresh() without them."
                )
            return find_chain(self._directory)
        chain = [*old.chain, *(read_manifest(d) for d in deltas or [])]
        check_chain(chain)
        return chain

    def _open_new(self, manifests: list[ExportManifest], first: bool) -> dict[Path, dict[str, ExportTable]]:
        """The tables of exports not served yet, opened and checked as ``verify`` says."""
        out = {}
        for i, m in enumerate(manifests):
            # The path may hold another export than when it was last opened (exports are meant to be
            # immutable, but one can be deleted and written again under the same name): its files
            # are opened afresh.
            self._files.forget_under(m.path)
            opened = {name: ExportTable.open(m.path, entry, self._files) for name, entry in m.tables.items()}
            is_base = first and i == 0
            if self._verify == "all" or (self._verify == "deltas" and not is_base):
                for table in opened.values():
                    table.verify()
            out[m.path] = opened
        return out

    def _install(self, gen: _Generation, new: list[ExportManifest] | None) -> None:
        """Serve ``gen``: move the caches to it (dropping the rows the ``new`` deltas touch, or
        starting them afresh), then swap the generation in one assignment."""
        if new is None:
            self._caches = self._make_caches(gen)
        else:
            for name, cache in self._caches.items():
                cache.advance(gen.number, _touched(new, self._opened, name, cache.capacity))
        self._generation = gen

    def _forget(self, old: tuple[ExportManifest, ...], chain: list[ExportManifest]) -> None:
        """Let go of the exports that left the chain (lookups still reading them finish first)."""
        kept = {m.path for m in chain}
        for m in old:
            if m.path not in kept:
                self._opened.pop(m.path, None)
                self._files.forget_under(m.path)

    def _make_caches(self, gen: _Generation) -> dict[str, RowCache]:
        """A cache per table, sharing ``cache_bytes`` in proportion to each table's bytes."""
        weight = {name: max(t.rows, 1) * (4 * t.dim + 16) for name, t in gen.tables.items()}
        total = sum(weight.values()) or 1
        return {
            name: RowCache(self._cache_bytes * w // total, gen.tables[name].dim, gen.number)
            for name, w in weight.items()
        }

    def follow(self, seconds: float) -> None:
        """Call :meth:`refresh` every ``seconds`` on a daemon thread until :meth:`close` (serving
        directories only). A refresh that fails is kept in :attr:`refresh_error` and logged as a
        warning (once, until it fails otherwise or succeeds); the previous generation keeps serving
        and the next poll tries again."""
        if self._directory is None:
            raise ConfigError("follow: only a serving directory (a directory of exports) can be followed.")
        seconds = _parse_seconds(seconds, "follow")
        if self._follower is not None:
            raise ConfigError("follow: already following.")
        self._follower = threading.Thread(
            target=self._poll, args=(seconds,), name="hierps-serving-follow", daemon=True
        )
        self._follower.start()

    def wait_for_poll(self, timeout: float | None = None) -> bool:
        """Wait until the follower has finished a poll that began after this call: True then
        (:attr:`generation` and :attr:`refresh_error` say what it found, e.g. an export written
        before the call), False if ``timeout`` seconds passed first or the tables were closed."""
        if self._follower is None:
            raise ConfigError("wait_for_poll: these tables are not following; open them with follow=seconds.")
        timeout = None if timeout is None else _parse_seconds(timeout, "timeout")
        with self._polled:
            target = self._polls_started + 1
            self._polled.wait_for(lambda: self._polls_done >= target or self._stop.is_set(), timeout)
            return self._polls_done >= target

    def _poll(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            with self._polled:
                self._polls_started += 1
            try:
                self.refresh()
                self.refresh_error, self._reported = None, None
            except Exception as exc:  # kept and reported; this generation serves on, the next poll retries
                self.refresh_error = exc
                self._report(exc)
            finally:
                with self._polled:
                    self._polls_done += 1
                    self._polled.notify_all()

    def _report(self, exc: Exception) -> None:
        """Log a failed refresh, once for as long as it fails the same way."""
        if str(exc) == self._reported:
            return
        self._reported = str(exc)
        expected = isinstance(exc, (HierpsError, OSError))  # else a bug: with its traceback
        log.log(
            logging.WARNING if expected else logging.ERROR,
            "refresh of %s failed; still serving checkpoint %s: %s",
            self._directory,
            self.checkpoint,
            exc,
            exc_info=None if expected else exc,
        )

    # -- closing -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop following and close the files; lookups then raise :class:`StoreClosedError`."""
        self._stop.set()
        with self._polled:
            self._polled.notify_all()
        if self._follower is not None and self._follower is not threading.current_thread():
            self._follower.join()
        with self._refresh_lock:
            self._closed = True
            self._files.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("these serving tables were closed; open the exports again.")

    def __enter__(self) -> ServingTables:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same(chain: list[ExportManifest], old: tuple[ExportManifest, ...]) -> bool:
    return len(chain) == len(old) and _common_prefix(chain, old) == len(old)


def _common_prefix(chain: list[ExportManifest], old: tuple[ExportManifest, ...]) -> int:
    """How many exports ``chain`` and ``old`` start with alike (same path, same manifest)."""
    n = 0
    for a, b in zip(chain, old):
        if a != b:
            break
        n += 1
    return n


def _touched(
    new: list[ExportManifest], opened: dict[Path, dict[str, ExportTable]], table: str, limit: int
) -> np.ndarray | None:
    """The keys of ``table`` the ``new`` deltas write or delete, or None when more than ``limit``."""
    parts: list[np.ndarray] = []
    count = 0
    for m in new:
        layer = opened[m.path].get(table)
        if layer is None:
            continue
        count += layer.entry.rows + layer.entry.deleted
        if count > limit:
            return None
        parts += [*layer.sorted_keys("keys"), *layer.sorted_keys("deleted")]
    return np.concatenate([np.empty(0, np.int64), *parts])


def _parse_seconds(value: Any, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < float(value) <= threading.TIMEOUT_MAX
    ):
        raise ConfigError(
            f"{what}: expected a number of seconds in (0, {threading.TIMEOUT_MAX:g}], e.g. {what}=30"
            f"{' (or None not to follow)' if what == 'follow' else ''}. Got {value!r} instead."
        )
    return float(value)


def _paths(values: Any, what: str) -> list[Path]:
    """A list of export paths, each checked to be one: ``ConfigError`` otherwise."""
    if isinstance(values, (str, bytes, os.PathLike)) or not isinstance(values, (list, tuple)):
        raise ConfigError(f"{what}: expected a list of export paths. Got {values!r} instead.")
    return [_path(v, what) for v in values]


def _path(value: Any, what: str) -> Path:
    if not isinstance(value, (str, os.PathLike)) or "\0" in os.fspath(value):
        raise ConfigError(
            f"{what}: expected the path of an export (a str or path without NUL bytes). Got {value!r} instead."
        )
    return Path(value)


def _parse_verify(verify: str) -> str:
    if verify not in VERIFY:
        raise ConfigError(f"verify: expected one of {VERIFY}. Got {verify!r} instead.")
    return verify


def open(
    path: str | os.PathLike[str],
    deltas: list[str | os.PathLike[str]] | None = None,
    *,
    unknown: str | None = None,
    cache_bytes: int | str = DEFAULT_CACHE_BYTES,
    follow: float | None = None,
    verify: str = "deltas",
) -> ServingTables:
    """Tables from an export plus deltas applied in order, or from a serving directory.

    ``path``: a full export (then ``deltas``: a list of exports each taken since the previous
    one's checkpoint, of the same store, in that order), or a directory of exports (base and delta
    chain found by their manifests, see :mod:`hierps.serving._chain`; ``deltas`` must then be
    None). ``unknown``: ``"initializer"`` or ``"zeros"`` for keys without a row (default: what each
    table's manifest says). ``cache_bytes`` (int or ``"64MiB"``): RAM for recently read rows,
    shared by the tables. ``follow``: for a serving directory, seconds between polls for new
    exports, a number in (0, ``threading.TIMEOUT_MAX``] (see :meth:`ServingTables.follow`).
    ``verify``: which exports are read whole and compared with their checksums when applied:
    ``"deltas"`` (default; a base is then checked chunk by chunk as it is read), ``"all"``, or
    ``"none"``.

    Opening reads the manifests and, per table, the fences and filter (under 2 bytes per key): no
    row of a base, so it takes about as long at 10^8 rows as at 10^6.
    """
    if unknown is not None and unknown not in UNADMITTED_VALUES:
        raise ConfigError(f"unknown: expected one of {UNADMITTED_VALUES}. Got {unknown!r} instead.")
    size = parse_size(cache_bytes, "cache_bytes")
    seconds = None if follow is None else _parse_seconds(follow, "follow")
    root = _path(path, "path")
    if is_export(root):
        chain, directory = explicit_chain(root, _paths(deltas or [], "deltas")), None
    elif deltas:
        raise ConfigError(
            f"{root}: has no manifest.json, so it is a serving directory, which finds its own "
            "deltas; pass deltas=None, or pass an export as the base."
        )
    else:
        chain, directory = find_chain(root), root
    tables = ServingTables(chain, directory, unknown, size, _parse_verify(verify))
    if seconds is not None:
        try:
            tables.follow(seconds)
        except BaseException:
            tables.close()
            raise
    return tables

"""Which exports to serve: a base and its chain of deltas, given as paths or found in a directory.

A *serving directory* holds exports as subdirectories, under any names. Its chain is its newest
full export (the base) and then, in order, the delta taken since the base's checkpoint, the one
taken since that delta's checkpoint, and so on (when several deltas start at the same checkpoint,
the one reaching furthest is taken). Exports off the chain are ignored, so old deltas can be left
in place and a new base starts a new chain. Exports of another format version are ignored too
(with a warning), so that exports written before an upgrade can stay; names starting with a dot
are exports being written (``.<name>.tmp-<pid>``), and those a killed writer left are removed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hierps.errors import ConfigError, StoreFormatError
from hierps.storage._export_format import MANIFEST, ExportManifest, read_manifest
from hierps.storage._files import remove_stale_temp_dirs

__all__ = ["check_chain", "explicit_chain", "find_chain", "is_export"]

log = logging.getLogger("hierps.serving")


def is_export(path: Path) -> bool:
    return (path / MANIFEST).exists()


def explicit_chain(base: Path, deltas: list[Path]) -> list[ExportManifest]:
    """The manifests of ``base`` and ``deltas``, checked to form a chain."""
    _tidy(base.parent)
    chain = [read_manifest(p) for p in [base, *deltas]]
    check_chain(chain)
    return chain


def check_chain(chain: list[ExportManifest]) -> None:
    """A full export first, then deltas each taken since the checkpoint of the one before."""
    if chain[0].since is not None:
        raise ConfigError(
            f"{chain[0].path}: is a delta (since checkpoint {chain[0].since}), not a full export; "
            "start from a full export (hierps export STORE OUT)."
        )
    for before, m in zip(chain, chain[1:]):
        if m.since != before.checkpoint:
            raise ConfigError(
                f"{m.path}: is {'a full export' if m.since is None else f'a delta since checkpoint {m.since}'}, "
                f"but the rows so far are as of checkpoint {before.checkpoint}. Pass deltas in order, each "
                "taken since the previous one's checkpoint."
            )


def find_chain(root: Path) -> list[ExportManifest]:
    """The newest full export under ``root`` and the longest-reaching chain of deltas from it."""
    if not root.is_dir():
        raise ConfigError(f"{root}: is neither an export (no {MANIFEST}) nor a directory of exports.")
    _tidy(root)
    found, other = [], []
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or not is_export(p):
            continue
        try:
            found.append(read_manifest(p))
        except StoreFormatError as exc:
            other.append(exc)
            log.warning("serving directory %s: skipping %s", root, exc)
    bases = [m for m in found if m.since is None]
    if not bases:
        if other:
            raise other[0]
        raise ConfigError(
            f"{root}: holds no full export (a subdirectory whose {MANIFEST} has since null); "
            "write one with hierps export STORE OUT."
        )
    chain = [max(bases, key=lambda m: m.checkpoint)]
    while True:
        at = chain[-1].checkpoint
        nxt = [m for m in found if m.since == at and m.checkpoint > at]
        if not nxt:
            return chain
        chain.append(max(nxt, key=lambda m: m.checkpoint))


def _tidy(root: Path) -> None:
    """Remove what killed exports left under ``root`` (nothing where it cannot be written)."""
    try:
        for p in remove_stale_temp_dirs(root):
            log.info("removed %s, left by an export that did not finish", p)
    except OSError:
        pass

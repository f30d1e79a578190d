"""Which exports to serve: a base and its chain of deltas, given as paths or found in a directory.

An export gives the rows of one checkpoint of one store, and a delta applies to the rows of one
(:class:`~hierps.storage._export_format.CheckpointRef`: the store's uid, the checkpoint's id and
when it was taken). A delta applies only to the rows it was taken since: not to those of another
store whose checkpoint has the same number (a store recreated and trained again), nor to a
checkpoint of the same number taken before a rollback.

A *serving directory* holds exports as subdirectories, under any names. Its base is the full export
of the checkpoint taken last, and its chain the deltas that lead from it to the rows of the
checkpoint taken last that they reach, fewest deltas first. Exports off the chain are ignored when
their checkpoint was taken before the chain's last one, so old deltas can be left in place and a
new base (of this store or of another) starts a new chain. A delta taken after it that the chain
does not reach is an error (:func:`find_chain`): a delta missing in between, or a delta of another
store. Exports of another format version are ignored (with a warning), so that exports written
before an upgrade can stay; names starting with a dot are exports being written
(``.<name>.tmp-<pid>``), and those a killed writer left are removed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hierps.errors import ConfigError, StoreFormatError
from hierps.storage._export_format import MANIFEST, CheckpointRef, ExportManifest, read_manifest
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
        start = m.applies_to
        if start is None or (start.store == before.store and m.since != before.checkpoint):
            raise ConfigError(
                f"{m.path}: is {'a full export' if m.since is None else f'a delta since checkpoint {m.since}'}, "
                f"but the rows so far are as of checkpoint {before.checkpoint}. Pass deltas in order, each "
                "taken since the previous one's checkpoint."
            )
        if start != before.state:
            raise ConfigError(f"{m.path}: is {_applies_elsewhere(m, start, before.state, before.path)}")


_SERVE_FULL = "Serve a full export of checkpoint {checkpoint} of the delta's store (hierps export STORE OUT)."
_WRITE_FULL = (
    "Write a full export of checkpoint {checkpoint} of the delta's store into this directory (hierps "
    "export STORE OUT): it becomes the base."
)


def _applies_elsewhere(
    m: ExportManifest, start: CheckpointRef, rows: CheckpointRef, where: Path, advice: str = _SERVE_FULL
) -> str:
    """Why delta ``m``, applying to the rows ``start``, cannot apply to ``rows`` (those of the export
    ``where``), and ``advice``: words to follow ``<path of m>: is``."""
    if start.store != rows.store:
        why = "they are another store's (a store created again, or another model)"
    elif start.ranks != rows.ranks:
        why = f"they are of {rows.ranks} rank store(s) and the delta's of {start.ranks}"
    elif start.id == rows.id:
        why = "the store was rolled back and checkpointed again in between, so they differ"
    else:
        why = "no export here leads from them to the delta's (the store was rolled back since?)"
    return (
        f"a delta that applies to the rows of {start.describe()}, but the rows so far ({where}) are those "
        f"of {rows.describe()}: {why}, and the delta applied to them would give rows no checkpoint held. "
        + advice.format(checkpoint=m.checkpoint)
    )


def find_chain(root: Path) -> list[ExportManifest]:
    """The chain of the exports under ``root`` (see the module's docstring), base first.

    ``ConfigError`` when a delta taken after the chain's last checkpoint cannot be reached from it:
    one missing in between (naming it), or a delta of another store."""
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
    chain = _reach(max(bases, key=lambda m: _taken(m.state)), found)
    end = chain[-1].state
    ahead = [m for m in found if _taken(m.state) > _taken(end)]
    if ahead:
        first = min(ahead, key=lambda m: _taken(m.applies_to or m.state))
        raise ConfigError(f"{root}: {_unreachable(first, chain[-1])}")
    return chain


def _taken(ref: CheckpointRef) -> tuple[float, int]:
    return ref.created, ref.id


def _reach(base: ExportManifest, found: list[ExportManifest]) -> list[ExportManifest]:
    """``base`` and the fewest deltas of ``found`` that lead from it to the rows of the checkpoint
    taken last among those reachable (a breadth-first walk, in the order of ``found``)."""
    paths = {base.state: [base]}
    todo = [base.state]
    for at in todo:
        for m in found:
            if m.applies_to == at and m.state not in paths:
                paths[m.state] = [*paths[at], m]
                todo.append(m.state)
    return paths[max(paths, key=_taken)]


def _unreachable(m: ExportManifest, last: ExportManifest) -> str:
    """Why the chain ending at ``last`` cannot reach ``m``, a delta of a later checkpoint, and what to do."""
    start, end = m.applies_to, last.state
    if start is None:  # (a full export is never ahead of the base: it would be the base)
        return f"{m.path} cannot follow {last.path}."
    if start.store == end.store and start.ranks == end.ranks and start.id > end.id:
        return (
            f"the chain of exports ends at checkpoint {end.id} ({last.path}), but {m.path} is a delta "
            f"from checkpoint {start.id} to {m.checkpoint} of the same store: the delta from checkpoint "
            f"{end.id} to checkpoint {start.id} is missing. Export it into this directory (hierps export "
            f"STORE OUT --since {end.id} --checkpoint {start.id}), or a full export of checkpoint "
            f"{m.checkpoint}."
        )
    return f"{m.path} is {_applies_elsewhere(m, start, end, last.path, _WRITE_FULL)}"


def _tidy(root: Path) -> None:
    """Remove what killed exports left under ``root`` (nothing where it cannot be written)."""
    try:
        for p in remove_stale_temp_dirs(root):
            log.info("removed %s, left by an export that did not finish", p)
    except OSError:
        pass

"""Small file-system helpers for durability: fsync of trees and atomic JSON replacement."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from hierps.errors import CorruptStoreError

__all__ = ["fsync_dir", "fsync_tree", "read_json_checked", "write_json_atomic"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (files first, then their directories)."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_json_atomic(path: Path, body: dict[str, Any]) -> None:
    """Write ``body`` to ``path`` so that readers see the old file or the whole new one.

    The body is stored with its CRC-32 so that a flipped byte is detected on read.
    """
    text = json.dumps(body, sort_keys=True, indent=1)
    doc = {"crc32": zlib.crc32(text.encode("utf-8")), "body": body}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json_checked(path: Path) -> dict[str, Any]:
    """The body written by :func:`write_json_atomic`; ``CorruptStoreError`` naming the file otherwise."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        body = doc["body"]
        crc = int(doc["crc32"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptStoreError(
            f"{path}: cannot be read as a hierps manifest ({exc}); the file is truncated or damaged. "
            "Restore it from a backup or open an earlier checkpoint."
        ) from exc
    text = json.dumps(body, sort_keys=True, indent=1)
    if zlib.crc32(text.encode("utf-8")) != crc:
        raise CorruptStoreError(
            f"{path}: checksum mismatch (the file was modified or damaged). "
            "Restore it from a backup or open an earlier checkpoint."
        )
    return body

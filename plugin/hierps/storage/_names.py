"""Table names: each is a directory name in a store, its checkpoints and its exports."""

from __future__ import annotations

__all__ = ["table_name_problem", "valid_table_name"]

_NAME_BYTES = 255  # the longest file name Linux file systems hold
# Names a table cannot take: files beside the tables' directories (an export's root, a store's).
_RESERVED = frozenset({"zarr.json", "manifest.json"})


def table_name_problem(name: object) -> str | None:
    """What keeps ``name`` from being a table name (it is a directory name in the store, its
    checkpoints and exports), or None: a non-empty str, at most 255 bytes in UTF-8, without '/' or
    NUL, not starting with '_' or '.', not a name a file beside the tables takes."""
    if not isinstance(name, str):
        return f"a str, not {type(name).__name__}"
    if not name or "/" in name or "\0" in name or name.startswith(("_", ".")):
        return "a non-empty name without '/' or NUL, not starting with '_' or '.'"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "a name that is valid UTF-8 (it holds a lone surrogate)"
    if size > _NAME_BYTES:
        return f"at most {_NAME_BYTES} bytes in UTF-8 (a file name); it has {size}"
    if name.casefold() in _RESERVED:
        return f"a name other than {sorted(_RESERVED)} (files of the store and of its exports)"
    return None


def valid_table_name(name: object) -> bool:
    """Whether ``name`` can be a table name: see :func:`table_name_problem`."""
    return table_name_problem(name) is None

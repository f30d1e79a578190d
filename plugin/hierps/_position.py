"""Where the training data was at a checkpoint: the loader's state, kept in the checkpoint's manifest.

A checkpoint that holds the rows, the dense state and the pending admissions but not the data
position makes a resumed run train examples twice or skip them. A store therefore tracks one data
source (:meth:`hierps.Store.track_data`; a :class:`hierps.PassLoader` tracks itself): any object
with ``state_dict()`` / ``load_state_dict(state)``, such as torchdata's ``StatefulDataLoader``.
Each checkpoint stores the source's state in its manifest (``extra["data_position"]``, written
with the rest of the manifest, so it is atomic with the rows), and opening or restoring the store
at a checkpoint hands that state back to the source (now, or when one is tracked later), so that
iterating it again resumes at the batch after the last one trained.

The state is JSON, never pickle: :func:`encode_state` writes what loaders' states hold (str-keyed
and int-keyed dicts, lists, tuples, ints, floats including nan / inf, str, bytes, None, torch
tensors and numpy arrays, such as a sampler's generator state) as tagged JSON, and
:func:`decode_state` reads it back to equal values; anything else is refused with the path of the
value in the state.
"""

from __future__ import annotations

import base64
import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from hierps.errors import ConfigError

__all__ = ["DataPositions", "StatefulSource", "decode_state", "encode_state"]

_log = logging.getLogger("hierps.position")
EXTRA_KEY = "data_position"
_TAG = "__hierps__"
_FORMAT = 1


@runtime_checkable
class StatefulSource(Protocol):
    """A data source whose position can be saved: torchdata's ``StatefulDataLoader``, a
    :class:`hierps.PassLoader`, :class:`hierps.online.ParquetStream`, or any object like them."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class DataPositionWarning(UserWarning):
    """A checkpoint is restored without a data position for the tracked loader (see the message)."""


class DataPositions:
    """One store's tracked data source and the position of the checkpoint it is at."""

    def __init__(self) -> None:
        self.source: StatefulSource | None = None
        self.saved: Any = None  # the decoded state of the checkpoint the store is at, or None
        self.pending = False  # ``saved`` is not yet handed to a source

    def track(self, source: StatefulSource | None) -> None:
        """Save ``source``'s state with each checkpoint from now on (None: stop); a position saved
        with the checkpoint the store is at, not yet handed to a source, goes to it now."""
        if source is not None and not isinstance(source, StatefulSource):
            raise ConfigError(
                f"track_data: expected an object with state_dict() and load_state_dict(state) (torchdata's "
                f"StatefulDataLoader, a hierps.PassLoader). Got {type(source).__name__}."
            )
        self.source = source
        if source is not None and self.pending:
            self._hand_over()

    def snapshot(self) -> dict[str, Any] | None:
        """The tracked source's state as the manifest keeps it, or None without a source."""
        if self.source is None:
            return None
        return {"format": _FORMAT, "state": encode_state(self.source.state_dict(), "state")}

    def loaded(self, extra: Mapping[str, Any] | None, checkpoint: int | None) -> None:
        """The store went to ``checkpoint`` (manifest ``extra``; None: no checkpoint): its position
        goes to the tracked source, or waits for one."""
        record = (extra or {}).get(EXTRA_KEY)
        self.saved = _parse_record(record, checkpoint) if record is not None else None
        self.pending = self.saved is not None
        if self.source is None:
            return
        if self.pending:
            self._hand_over()
        elif checkpoint is not None:
            warnings.warn(
                f"checkpoint {checkpoint} holds no data position (it was made before a loader was tracked, or "
                "resharded from another number of ranks, whose per-rank positions do not carry over): the "
                "tracked loader keeps its current position.",
                DataPositionWarning,
                stacklevel=4,
            )

    def _hand_over(self) -> None:
        assert self.source is not None
        self.source.load_state_dict(self.saved)
        self.pending = False
        _log.info("data position restored into %s", type(self.source).__name__)


def _parse_record(record: Any, checkpoint: int | None) -> Any:
    if not isinstance(record, dict) or record.get("format") != _FORMAT or "state" not in record:
        raise ConfigError(
            f"checkpoint {checkpoint}: its data position is not one this version reads (expected "
            f'{{"format": {_FORMAT}, "state": ...}}, got {str(record)[:120]}). Open it with the hierps '
            "version that wrote it, or stop tracking a loader."
        )
    return decode_state(record["state"])


# -- the JSON codec ----------------------------------------------------------------------------------
def encode_state(obj: Any, where: str = "state") -> Any:
    """A loader's state -> JSON values (see the module docstring); ``ConfigError`` naming ``where``
    (the path in the state) for a value that JSON cannot hold without pickle."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_TAG: "float", "value": repr(obj)}
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return encode_state(obj.item(), where)
    if isinstance(obj, list):
        return [encode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "items": [encode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: encode_state(v, f"{where}[{k!r}]") for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if k is not None and not isinstance(k, (str, int, float, bool, tuple)):
                raise ConfigError(
                    f"data position: {where} has a key of type {type(k).__name__}, {k!r}: " + _HOW
                )
            items.append([encode_state(k, f"{where} key"), encode_state(v, f"{where}[{k!r}]")])
        return {_TAG: "dict", "items": items}
    if isinstance(obj, (bytes, bytearray)):
        return {_TAG: "bytes", "data": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {
            _TAG: "tensor",
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()).decode(),
        }
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biuf":
        a = np.ascontiguousarray(obj)
        return {
            _TAG: "ndarray",
            "dtype": a.dtype.str,
            "shape": list(a.shape),
            "data": base64.b64encode(a.tobytes()).decode(),
        }
    raise ConfigError(f"data position: {where} is a {type(obj).__name__}: " + _HOW)


_HOW = (
    "a loader's state is saved as JSON (dicts, lists, tuples, numbers, str, bytes, tensors, numeric "
    "arrays), never pickled. Make the loader's (or its dataset's / sampler's) state_dict() return such values."
)


def decode_state(obj: Any) -> Any:
    """:func:`encode_state`'s JSON -> the state it was made from (tensors on the CPU)."""
    if isinstance(obj, list):
        return [decode_state(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    kind = obj.get(_TAG)
    if kind is None:
        return {k: decode_state(v) for k, v in obj.items()}
    if kind == "float":
        return float(obj["value"])
    if kind == "tuple":
        return tuple(decode_state(v) for v in obj["items"])
    if kind == "dict":
        return {_hashable(decode_state(k)): decode_state(v) for k, v in obj["items"]}
    if kind == "bytes":
        return base64.b64decode(obj["data"])
    if kind == "tensor":
        dtype = getattr(torch, obj["dtype"])
        raw = bytearray(base64.b64decode(obj["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(obj["shape"]).clone()
    if kind == "ndarray":
        data = np.frombuffer(base64.b64decode(obj["data"]), dtype=np.dtype(obj["dtype"]))
        return data.reshape(obj["shape"]).copy()
    raise ConfigError(f"data position: unknown tagged value {kind!r}; written by another hierps version?")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key

"""Pass-aware data loading: read a pass of mini-batches ahead and load its rows before it runs.

The paper trains in passes: the distinct ids of the next ``pass_batches`` mini-batches (the
working set) are pulled from RAM / SSD into the device tier in one sorted batch, then the
mini-batches run against the device tier alone. :class:`PassLoader` wraps any iterable of
batches (a ``DataLoader``, DeepSpeed's loader, a list) to do exactly that::

    loader = PassLoader(train_loader, lambda b: {"user": b["user_ids"]}, engine)
    for batch in loader:          # begin_pass(next 16 batches) happened before the first
        loss = engine(batch)      # end_pass() happens once the 16th batch was trained on
        engine.backward(loss)
        engine.step()

Without it, training is still correct: rows are fetched on demand, one mini-batch at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from hierps.errors import ConfigError, StoreClosedError
from hierps.store import Store

__all__ = ["PassLoader"]

IdsFn = Callable[[Any], Mapping[str, Any]]
_DEFAULT_PASS_BATCHES = 16


class PassLoader:
    """Yields the batches of ``loader`` unchanged, loading each pass's rows into the device tier first.

    Args:
        loader: any iterable of batches; it is iterated once per ``iter(PassLoader)``.
        ids: ``batch -> {module_name: ids}`` (ids: any-shape int64 tensor / array of the batch's
            feature ids for that module's table), or a mapping ``{module_name: key}`` read as
            ``batch[key]`` (dict batches with str keys, tuple batches with int keys), or None to
            use the ``batch_ids`` mapping of the engine's ``hierarchical_ps`` section.
        target: the :class:`hierps.Store`, or an engine from ``hierps.deepspeed.initialize``.
        pass_batches: mini-batches per pass; default the section's ``pass_batches`` (16 for a store).

    Each pass: ``pass_batches`` batches are read, ``store.begin_pass`` gets their ids (one dict
    per batch, in order), they are yielded one by one, and ``store.end_pass`` runs when the
    next batch is asked for (so after the last one's optimizer step), or when iteration stops.
    """

    def __init__(self, loader: Iterable[Any], ids: IdsFn | Mapping[str, Any] | None, target: Any,
                 pass_batches: int | None = None) -> None:
        self.loader = loader
        self.store = _store_of(target)
        section = getattr(target, "hierps_config", None)
        if pass_batches is None:
            pass_batches = section.pass_batches if section is not None else _DEFAULT_PASS_BATCHES
        if isinstance(pass_batches, bool) or not isinstance(pass_batches, int) or pass_batches < 1:
            raise ConfigError(f"pass_batches: expected an int >= 1. Got {pass_batches!r} instead.")
        self.pass_batches = pass_batches
        if ids is None:
            ids = section.batch_ids if section is not None else None
            if ids is None:
                raise ConfigError(
                    "PassLoader: no ids given. Pass a function batch -> {module_name: ids}, a mapping "
                    "{module_name: batch key}, or set \"batch_ids\" in the hierarchical_ps section."
                )
        self.ids_of: IdsFn = ids if callable(ids) else _by_key(dict(ids))

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        in_pass = False
        try:
            while True:
                group = list(itertools.islice(batches, self.pass_batches))
                if not group:
                    return
                self.store.begin_pass([self.ids_of(b) for b in group])
                in_pass = True
                yield from group
                in_pass = False
                self.store.end_pass()
        finally:
            if in_pass:  # the consumer stopped mid-pass: write its rows back all the same
                try:
                    self.store.end_pass()
                except StoreClosedError:
                    pass


def _store_of(target: Any) -> Store:
    if isinstance(target, Store):
        return target
    store = getattr(target, "hierps_store", None)
    if isinstance(store, Store):
        return store
    raise ConfigError(
        f"PassLoader: expected a hierps.Store or an engine from hierps.deepspeed.initialize (with "
        f"hierps_store). Got {type(target).__name__}; was the hierarchical_ps section enabled?"
    )


def _by_key(mapping: dict[str, Any]) -> IdsFn:
    """``{module: key}`` -> ``batch -> {module: batch[key]}``, with an error naming a missing key."""

    def ids_of(batch: Any) -> dict[str, Any]:
        out = {}
        for module, key in mapping.items():
            try:
                out[module] = batch[key]
            except (KeyError, IndexError, TypeError):
                raise ConfigError(
                    f"batch_ids: module {module!r} reads batch[{key!r}], which this batch does not have "
                    f"(a {type(batch).__name__}). Map each module to a key of the batch."
                ) from None
        return out

    return ids_of
